//! Devices the programs no longer go on (dropped from `--interface`, or without their default
//! route) whose flows still need them: the chain stops returning their traffic to the programs,
//! but the programs stay until no flow they translate through the device is left, so that no
//! connection breaks for a change of selection. A device that vanishes or loses its address is
//! released at once: replies to its flows can no longer reach the node.

use std::collections::BTreeMap;

use masq_ebpf::{Address, NatEntry, NatKey};
use tracing::info;

use super::{expiry, flow_table::NatTable, plane::EbpfDataPlane};
use crate::netdev::{self, DeviceState};

impl EbpfDataPlane {
    /// A device that no longer carries the programs: one that still exists with the same
    /// addresses keeps them while its flows drain; any other (gone, or without its address)
    /// is released at once, as its flows can no longer be answered anyway.
    pub(super) fn leave(&mut self, name: &str) -> anyhow::Result<()> {
        let before = self.devices.iter().find(|d| d.name == name);
        let kept = match (netdev::device_state(name)?, before) {
            (DeviceState::Usable(now), Some(before)) => (now == *before).then_some(now),
            // An earlier agent's: its flows are on the addresses it has now.
            (DeviceState::Usable(now), None) => Some(now),
            _ => None,
        };
        match kept {
            Some(device) => {
                info!(
                    device = name,
                    "device no longer selected: its programs stay while the flows they translate through it drain"
                );
                self.draining.push(device);
            }
            _ => self.release(name),
        }
        Ok(())
    }

    /// Releases the draining devices that vanished or changed: their flows cannot be answered.
    pub(super) fn drop_vanished_draining(&mut self) -> anyhow::Result<()> {
        for device in self.draining.clone() {
            if netdev::device_state(&device.name)? != DeviceState::Usable(device.clone()) {
                self.end_draining(&device.name)?;
            }
        }
        Ok(())
    }

    /// Releases the draining devices through which no translated flow is left.
    pub(super) fn release_drained(&mut self) -> anyhow::Result<()> {
        if self.draining.is_empty() {
            return Ok(());
        }
        let v4 = translated_by_address(&self.maps.nat.v4)?;
        let v6 = translated_by_address(&self.maps.nat.v6)?;
        for device in self.draining.clone() {
            let left = v4.get(&device.ipv4.octets()).copied().unwrap_or(0)
                + device
                    .ipv6
                    .and_then(|a| v6.get(&a.octets()).copied())
                    .unwrap_or(0);
            if left == 0 {
                info!(
                    device = device.name,
                    "the device's last translated flow ended"
                );
                self.end_draining(&device.name)?;
            }
        }
        Ok(())
    }

    /// Takes a draining device's programs off, its entry out of `interfaces` and its flows out
    /// of the tables.
    fn end_draining(&mut self, name: &str) -> anyhow::Result<()> {
        let Some(at) = self.draining.iter().position(|d| d.name == name) else {
            return Ok(());
        };
        let device = self.draining.remove(at);
        self.release(name);
        self.write_interfaces()?;
        self.forget_flows(&device, None)
    }
}

/// How many flows the programs translate to each node address, in one family's table.
fn translated_by_address<A>(nat: &NatTable<A>) -> anyhow::Result<BTreeMap<A, usize>>
where
    A: Address + Ord,
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    Ok(expiry::translated_by_address(&nat.read_all()?))
}

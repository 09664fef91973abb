//! Following the devices while the agent runs: the programs go on the devices the selection
//! picks as they appear, change and vanish, and the chain returns to the programs only what
//! leaves by a device they run on with its address, in an order that never lets a new flow
//! leave untranslated. A program that cannot be attached means the data plane cannot run here.

use tracing::{info, warn};

use super::{
    attach,
    devices::{self, Returned},
    expiry,
    hook::Hook,
    interfaces::write_interfaces,
    plane::{EbpfDataPlane, Unavailable},
};
use crate::{
    dataplane::interface::DataPlane as _,
    netdev::Device,
    policy::{IpFamily, Policy},
};

/// What following the devices changed.
pub(super) struct Followed {
    /// A device started or stopped carrying the programs, or changed its address or index.
    pub devices_changed: bool,
    /// A program found detached was attached again.
    pub reattached: bool,
}

impl EbpfDataPlane {
    /// Makes the programs run on the devices the selection picks now, and the chain return to
    /// them exactly what those devices can translate. A device's traffic leaves the chain's
    /// early returns before its programs go, and joins them only once its programs run with
    /// its address, so that no new flow leaves untranslated.
    pub(super) fn follow_devices(&mut self, policy: &Policy) -> anyhow::Result<Followed> {
        let carrying = self.carrying();
        let states = devices::states(&self.selection.followed()?)?;
        self.notes.report(&self.selection, &states, self.families);
        let fresh = devices::usable(&states);
        let kept = self.returned.common(&Returned::by(&fresh, self.families));
        self.return_to_programs(kept, policy)?;
        let leaving: Vec<String> = carrying
            .into_iter()
            .filter(|name| !fresh.iter().any(|d| d.name == *name))
            .collect();
        for device in &leaving {
            self.leave(device)?;
        }
        // A draining device selected again carries the programs again.
        self.draining
            .retain(|d| !fresh.iter().any(|f| f.name == d.name));
        self.drop_vanished_draining()?;
        self.inherited.clear();
        // Before the devices: a device that is new now gets the chosen address in force. The
        // chain beside the programs watches the node's addresses for both, and says each change
        // once.
        self.chain.follow_chosen(policy)?;
        let chosen_changed = self.chain.masquerade_addresses() != self.chosen_written;
        let mut changed = self.take_devices(fresh)?;
        if chosen_changed && !changed {
            self.write_interfaces()?;
            changed = true;
        }
        let reattached = self.ensure_attached();
        // A device whose programs could not be attached stays with the chain.
        let running: Vec<Device> = self
            .devices
            .iter()
            .filter(|d| self.runs_both_programs(&d.name))
            .cloned()
            .collect();
        self.return_to_programs(Returned::by(&running, self.families), policy)?;
        Ok(Followed {
            devices_changed: changed || !leaving.is_empty(),
            reattached: reattached?,
        })
    }

    fn runs_both_programs(&self, device: &str) -> bool {
        Hook::BOTH.into_iter().all(|hook| {
            self.attachments
                .iter()
                .any(|(d, h, _)| d == device && *h == hook)
        })
    }

    /// The devices that carry the programs, or did under an earlier agent.
    fn carrying(&self) -> Vec<String> {
        let mut names: Vec<String> = self.devices.iter().map(|d| d.name.clone()).collect();
        devices::merge(&mut names, &self.inherited);
        names
    }

    /// Installs the chain that returns `returned` to the programs, if it is not in force.
    fn return_to_programs(&mut self, returned: Returned, policy: &Policy) -> anyhow::Result<()> {
        if returned == self.returned {
            return Ok(());
        }
        for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
            self.chain.set_variant(family, returned.variant(family));
        }
        self.chain.apply(policy)?;
        self.returned = returned;
        Ok(())
    }

    /// Gives the programs `fresh`'s addresses. As MASQUERADE forgets its connections when their
    /// address goes, the flows on an address a device no longer has are forgotten: replies to it
    /// can no longer reach the node. Returns whether anything changed.
    fn take_devices(&mut self, fresh: Vec<Device>) -> anyhow::Result<bool> {
        if fresh == self.devices {
            return Ok(false);
        }
        let previous = std::mem::replace(&mut self.devices, fresh.clone());
        self.write_interfaces()?;
        for old in previous {
            let new = fresh.iter().find(|d| d.name == old.name);
            if let Some(new) = new.filter(|new| **new != old) {
                info!(device = new.name, old = ?(old.ipv4, old.ipv6), new = ?(new.ipv4, new.ipv6), index = new.index, "device changed");
            }
            // A draining device keeps its addresses, and its flows.
            let draining = self.draining.iter().find(|d| d.name == old.name).cloned();
            self.forget_flows(&old, new.or(draining.as_ref()))?;
        }
        Ok(true)
    }

    /// Makes the `interfaces` map hold the devices carrying the programs and those draining.
    pub(super) fn write_interfaces(&mut self) -> anyhow::Result<()> {
        let all: Vec<Device> = self.translating();
        let chosen = self.chain.masquerade_addresses();
        write_interfaces(&mut self.maps.interfaces, &all, self.families, chosen)?;
        self.chosen_written = chosen;
        Ok(())
    }

    /// The devices whose programs translate: those carrying them, and those draining.
    fn translating(&self) -> Vec<Device> {
        self.devices.iter().chain(&self.draining).cloned().collect()
    }

    /// Forgets the flows on the addresses `old` had and `new` (the same device now, if it still
    /// carries the programs) does not.
    pub(super) fn forget_flows(
        &mut self,
        old: &Device,
        new: Option<&Device>,
    ) -> anyhow::Result<()> {
        if new.is_none_or(|new| new.ipv4 != old.ipv4) {
            let purged = expiry::forget_address(&self.maps.nat.v4, old.ipv4.octets())?;
            info!(device = old.name, address = %old.ipv4, flows = purged, "flows on the old address forgotten");
        }
        if let Some(gone) = old
            .ipv6
            .filter(|addr| new.is_none_or(|new| new.ipv6 != Some(*addr)))
        {
            let purged = expiry::forget_address(&self.maps.nat.v6, gone.octets())?;
            info!(device = old.name, address = %gone, flows = purged, "flows on the old address forgotten");
        }
        Ok(())
    }

    /// Takes the programs off `device`: its flows are no longer translated.
    pub(super) fn release(&mut self, device: &str) {
        self.attachments.retain(|(name, _, _)| name != device);
        for hook in Hook::BOTH {
            let pin = self.pins.link(device, hook.name());
            attach::detach(device, hook, &pin, hook.program());
        }
        info!(device, "programs removed from the device");
    }

    /// Attaches wherever a program is missing: on a device that starts carrying them, and after
    /// someone detached one or its device was recreated. Draining devices too: their programs
    /// translate the flows that drain. Returns whether anything had to be attached again.
    fn ensure_attached(&mut self) -> Result<bool, Unavailable> {
        let mut repaired = false;
        for device in self.translating() {
            repaired |= self.attach_to(&device).map_err(Unavailable)?;
        }
        Ok(repaired)
    }

    /// Attaches both programs to `device`, where they do not run. Returns whether one had run
    /// there and been detached.
    fn attach_to(&mut self, device: &Device) -> anyhow::Result<bool> {
        let new = !self.attachments.iter().any(|(d, _, _)| *d == device.name);
        let mut repaired = false;
        for hook in Hook::BOTH {
            repaired |= self.attach_at(&device.name, hook)?;
        }
        if new {
            let ipv6 = device
                .ipv6
                .filter(|_| self.families.contains(IpFamily::Ipv6));
            info!(device = device.name, address = %device.ipv4, ?ipv6, "programs attached to the device");
        }
        Ok(repaired)
    }

    /// Attaches the program of `hook` to `device`, unless it runs there. Returns whether it had
    /// run there and been detached.
    fn attach_at(&mut self, device: &str, hook: Hook) -> anyhow::Result<bool> {
        let pin = self.pins.link(device, hook.name());
        let prog = self.programs.at(hook)?;
        let position = self
            .attachments
            .iter()
            .position(|(d, h, _)| d == device && *h == hook);
        if position.is_some() && attach::is_attached(prog, device, hook)? {
            return Ok(false);
        }
        if let Some(i) = position {
            warn!(
                device,
                hook = hook.name(),
                "program was detached; re-attaching"
            );
            self.attachments.remove(i);
            let _ = std::fs::remove_file(&pin);
        }
        let attachment = attach::attach(prog, device, hook, &pin)?;
        self.attachments
            .push((device.to_string(), hook, attachment));
        Ok(position.is_some())
    }
}

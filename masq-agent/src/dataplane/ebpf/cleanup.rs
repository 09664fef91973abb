//! Uninstalling: `masq-agent cleanup`, and the end of a drain once no translated flow is left.
//! Whatever was pinned outlives the agent by design, so nothing goes unless removed here.

use std::path::Path;

use anyhow::Context as _;
use masq_ebpf::map_names;

use super::{attach, hook::Hook, pins::Pins, tc_filters};
use crate::netdev;

/// What `cleanup` found and removed of the eBPF data plane.
#[derive(Debug, Default)]
pub struct Removed {
    /// `device hook` of each attachment: a pinned TCX link, or a clsact filter.
    pub attachments: Vec<String>,
    pub maps: Vec<&'static str>,
}

/// Detaches the programs and removes every pin under `bpffs`.
pub fn cleanup(bpffs: &Path) -> anyhow::Result<Removed> {
    let pins = Pins::new(bpffs);
    // The namespace's own devices: /sys/class/net shows those of whoever mounted /sys.
    let devices: Vec<String> = netdev::names_and_indexes()?
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let mut removed = Removed::default();
    for (device, hook, _) in pins.links() {
        removed
            .attachments
            .push(format!("{device} {}", hook.name()));
    }
    for device in &devices {
        for hook in Hook::BOTH {
            let ours = tc_filters::list(device, hook)
                .unwrap_or_default()
                .iter()
                .any(|f| f.name == hook.program());
            let named = format!("{device} {}", hook.name());
            if ours && !removed.attachments.contains(&named) {
                removed.attachments.push(named);
            }
        }
    }
    removed.attachments.sort();
    attach::detach_all(&pins.links_dir(), &devices, &Hook::BOTH.map(Hook::program))?;
    for name in map_names::PINNED {
        match std::fs::remove_file(pins.map(name)) {
            Ok(()) => removed.maps.push(name),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing pin {name}"));
            }
            Err(_) => {}
        }
    }
    for dir in [pins.links_dir(), pins.dir.clone()] {
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", dir.display()));
            }
            _ => {}
        }
    }
    Ok(removed)
}

//! Uninstalling: `masq-agent cleanup`, and the end of a drain once no translated flow is left.
//! Whatever was pinned outlives the agent by design, so nothing goes unless removed here.

use std::path::Path;

use anyhow::Context as _;
use masq_ebpf::map_names;

use super::{attach, attach::Hook, pins::Pins};
use crate::netdev;

/// Detaches the programs and removes every pin under `bpffs`.
pub fn cleanup(bpffs: &Path) -> anyhow::Result<()> {
    let pins = Pins::new(bpffs);
    // The namespace's own devices: /sys/class/net shows those of whoever mounted /sys.
    let devices: Vec<String> = netdev::names_and_indexes()?
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    attach::detach_all(&pins.links_dir(), &devices, &Hook::BOTH.map(Hook::program))?;
    for name in map_names::PINNED {
        match std::fs::remove_file(pins.map(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing pin {name}"));
            }
            _ => {}
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
    Ok(())
}

//! `masq-agent cleanup`: everything either data plane installed, removed.

use super::{
    ebpf,
    iptables::{command, plane},
    state,
};
use crate::policy::IpFamily;

/// What `cleanup` found and removed.
#[derive(Debug)]
pub struct Cleaned {
    pub bpffs: std::path::PathBuf,
    pub chain: String,
    pub ebpf: ebpf::cleanup::Removed,
    /// The families whose chain (or a jump to it) was there.
    pub chains: Vec<IpFamily>,
}

/// Removes everything either data plane installed, and says what it found.
pub fn cleanup_all(chain: &str, bpffs: &std::path::Path) -> anyhow::Result<Cleaned> {
    state::remove(bpffs);
    let ebpf = ebpf::cleanup::cleanup(bpffs)?;
    let chains = plane::cleanup(chain)?;
    Ok(Cleaned {
        bpffs: bpffs.to_path_buf(),
        chain: chain.to_string(),
        ebpf,
        chains,
    })
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut removed = Vec::new();
        if !self.ebpf.attachments.is_empty() {
            removed.push(format!(
                "the eBPF programs from {}",
                self.ebpf.attachments.join(", ")
            ));
        }
        if !self.ebpf.maps.is_empty() {
            removed.push(format!(
                "{} pinned maps under {}",
                self.ebpf.maps.len(),
                self.bpffs.display()
            ));
        }
        for family in &self.chains {
            let tool = command::binary(*family);
            removed.push(format!(
                "{tool} chain {} with its POSTROUTING jump",
                self.chain
            ));
        }
        if removed.is_empty() {
            writeln!(
                f,
                "nothing to remove: no programs of the agent's on this node's devices, nothing \
                 pinned under {}, no chain {}",
                self.bpffs.display(),
                self.chain
            )
        } else {
            writeln!(f, "removed {}", removed.join("; "))
        }
    }
}

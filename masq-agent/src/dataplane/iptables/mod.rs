//! The reference data plane: upstream's `nat` chain, byte for byte, applied with
//! `iptables-restore --noflush` so that only this chain changes, atomically. Beside the eBPF
//! programs, the chain matches the non-masquerade CIDRs through an ipset.

pub(in crate::dataplane) mod command;
mod evaluate;
pub mod ipset;
pub(in crate::dataplane) mod plane;
pub(in crate::dataplane) mod readback;
pub(in crate::dataplane) mod render;

pub use command::{Capabilities, jump_rule};
pub use evaluate::{ChainVerdict, chain_verdict};
pub use plane::{IptablesDataPlane, cleanup};
pub use readback::{ChainStatus, read_chains};
pub use render::{ChainVariant, render, set_members};

#[cfg(test)]
mod tests;

//! Ethernet + IPv4 and Ethernet + IPv6 frames built from scratch, with checksums computed in
//! full by this module's own code, for the packet tests and the data-path benchmark. Sharing
//! nothing with the eBPF programs' incremental checksum updates is the point: a test that checks
//! a translation with this code checks it independently.
//!
//! What both families share sits in `segment`; `family` writes the builders and checks once
//! over the family, and `ipv4` and `ipv6` say how each lays its headers out.

mod check;
mod family;
mod ipv4;
mod ipv6;
mod segment;

pub use check::*;
pub use family::*;
pub use ipv4::*;
pub use ipv6::*;
pub use segment::*;

#[cfg(test)]
mod tests;

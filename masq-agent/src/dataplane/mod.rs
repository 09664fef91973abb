//! Data planes make the kernel enforce a `Policy`. Two implement the same small interface:
//! `ebpf` (tc programs and LPM maps) and `iptables` (upstream's reference chain). Nothing outside
//! this module knows which one is running.

pub mod chosen_address;
mod cleanup;
pub mod coverage;
pub mod ebpf;
mod interface;
pub mod iptables;
mod mode;
mod nat_usage;
mod sorted;
pub mod state;
mod status;

pub use self::{
    cleanup::{Cleaned, cleanup_all},
    interface::{ApplyOutcome, DataPlane},
    mode::Mode,
    nat_usage::{FlowKind, NatSweep, NatUsage},
    sorted::walk_sorted,
    status::{Status, inspect},
};

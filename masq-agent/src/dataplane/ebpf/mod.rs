//! The eBPF data plane: masq-ebpf's tc programs on each selected device, the non-masquerade
//! tries they look destinations up in, the NAT table, and beside them the reference chain
//! reduced to what the programs leave alone: other protocols, and whatever leaves by a device
//! without them.

pub mod attach;
pub mod batch;
mod carry;
mod clashes;
pub mod cleanup;
mod conntrack;
pub mod decisions;
pub mod devices;
mod draining;
mod drop_sample;
pub mod expiry;
pub mod flow_table;
pub mod flows;
mod follow;
pub mod hook;
pub mod index_writer;
pub mod interfaces;
pub mod kernel_sweep;
pub mod leftovers;
mod load;
pub mod map_types;
pub mod maps;
pub mod node_ports;
mod options;
pub mod pins;
mod plane;
pub mod policy_index;
pub mod policy_word;
pub mod prefixes;
pub mod status;
pub mod strays;
mod syscall;
pub mod tc_filters;
#[cfg(feature = "testbed")]
pub mod testbed;
pub mod tick_clock;
pub mod trie_diff;
pub mod tries;

pub use self::{
    load::{COARSE_CLOCK_ENV, SLOT_TABLE_ENV},
    options::EbpfOptions,
    plane::{EbpfDataPlane, Unavailable, new},
};

//! The contract between masq-agent's tc programs and its userspace agent: map names, key and value
//! layouts, counter indices. Both sides compile this one file, so the layouts can never drift.
#![no_std]

/// Names of the maps as the object declares them; the agent pins each one under `--bpffs` with
/// the same name, so `bpftool map dump pinned <bpffs>/<name>` finds it.
pub mod map_names {
    pub const NON_MASQ_V4: &str = "non_masq_v4";
    pub const NON_MASQ_V6: &str = "non_masq_v6";
    pub const COUNTERS: &str = "counters";
}

/// Names of the programs in the object.
pub mod program_names {
    pub const EGRESS: &str = "masq_egress";
}

/// Capacity of each non-masquerade trie. Upstream caps a config at 64 CIDRs (`cidrLimit`), but the
/// cap is configurable and the trie costs nothing until used, so leave room for large policies.
pub const NON_MASQ_MAX_ENTRIES: u32 = 262_144;

/// Value stored for each prefix in the non-masquerade tries; only presence matters.
pub type NonMasqValue = u8;
pub const NON_MASQ_PRESENT: NonMasqValue = 1;

/// Per-CPU packet counters, one slot each in the `counters` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// IPv4 packets whose destination is in `non_masq_v4`.
    NonMasqDestination = 0,
    /// IPv4 packets that would be masqueraded.
    MasqueradeCandidate = 1,
    /// Packets the program does not look at (not IPv4, or too short to parse).
    NotInspected = 2,
}

impl Counter {
    pub const ALL: [Counter; 3] = [
        Counter::NonMasqDestination,
        Counter::MasqueradeCandidate,
        Counter::NotInspected,
    ];

    /// Stable, metric-friendly name.
    pub const fn name(self) -> &'static str {
        match self {
            Counter::NonMasqDestination => "non_masq_destination",
            Counter::MasqueradeCandidate => "masquerade_candidate",
            Counter::NotInspected => "not_inspected",
        }
    }
}

pub const COUNTER_SLOTS: u32 = Counter::ALL.len() as u32;

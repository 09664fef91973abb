//! The contract between masq-agent's tc programs and its userspace agent: map names, key and value
//! layouts, counter indices. Both sides compile this one file, so the layouts can never drift.
//! One job, the contract, whatever its length: split, it would be two places to keep in step.
#![cfg_attr(not(test), no_std)]

/// Names of the maps as the object declares them. The agent pins each one under `--bpffs` with
/// the same name, so `bpftool map dump pinned <bpffs>/<name>` finds it.
pub mod map_names {
    pub const NON_MASQ_V4: &str = "non_masq_v4";
    pub const NON_MASQ_V6: &str = "non_masq_v6";
    /// Prefixes recently removed from `non_masq_v4`, with the time of their removal (seconds of
    /// CLOCK_MONOTONIC): TCP connections to them that started unmasqueraded stay that way.
    pub const DRAINING_V4: &str = "non_masq_draining_v4";
    /// The same for `non_masq_v6`.
    pub const DRAINING_V6: &str = "non_masq_draining_v6";
    /// Sources whose traffic keeps its address (`nonMasqueradeSrcCIDRs`), and the exceptions
    /// to them, with their actions as in `non_masq_v4`; looked up only while
    /// `Settings::sources_decided` says the family has any.
    pub const NON_MASQ_SRC_V4: &str = "non_masq_src_v4";
    pub const NON_MASQ_SRC_V6: &str = "non_masq_src_v6";
    pub const NAT_V4: &str = "nat_v4";
    pub const NAT_V6: &str = "nat_v6";
    /// Where the kernel has BPF atomics (5.12), each family's halves in the slot table
    /// (`slot_table`) instead of `nat_v4` and `nat_v6`: its slots, and its buckets' words and
    /// its seed (`slot_table::seed_at`).
    pub const NAT_SLOTS_V4: &str = "nat_slots_v4";
    pub const NAT_SLOT_WORDS_V4: &str = "nat_slot_words_v4";
    pub const NAT_SLOTS_V6: &str = "nat_slots_v6";
    pub const NAT_SLOT_WORDS_V6: &str = "nat_slot_words_v6";
    pub const INTERFACES: &str = "interfaces";
    /// The devices of `interfaces` whose ifindex is below `INTERFACES_BY_IFINDEX_ENTRIES`, in an
    /// array the programs read before the hash table (`IndexedInterface`): an array's lookup
    /// is a few instructions, the hash table's a call that hashes and compares. The hash table
    /// stays the whole truth. Pinned as it is, so that the programs a restarted agent replaces
    /// read what it writes until they go.
    pub const INTERFACES_BY_IFINDEX: &str = "interfaces_by_ifindex";
    pub const SETTINGS: &str = "settings";
    pub const COUNTERS: &str = "counters";
    /// Bumped by the agent after every change to a policy trie; the programs' per-CPU verdict
    /// caches and index hold only verdicts of the current generation. Pinned, so that a restarted
    /// agent's programs and the ones they replace see the same generation.
    pub const POLICY_GENERATION: &str = "policy_generation";
    /// Per CPU, the decisions each entry of the policy tries took, by the entry's
    /// `PolicyEntry::counted_in`: how often it was asked about a packet of no known flow.
    /// Sized by the agent when it loads the object.
    pub const DECISIONS: &str = "policy_decisions";
    /// Each program object's per-CPU cache of `non_masq_v4` verdicts; not pinned.
    pub const NON_MASQ_CACHE_V4: &str = "non_masq_cache_v4";
    /// The same for `non_masq_v6`; named apart from IPv4's within the 15 characters the kernel
    /// keeps (`as_the_kernel_keeps`), which `non_masq_cache_v6` would not be.
    pub const NON_MASQ_CACHE_V6: &str = "non_masq_v6_cache";
    /// Each program object's index of `non_masq_v4` (`policy_index`), which the agent writes
    /// after every change to the trie; sized by the agent when it loads the object, not
    /// pinned.
    pub const NON_MASQ_INDEX_V4: &str = "non_masq_index_v4";

    /// `name` as the kernel keeps it (`BPF_OBJ_NAME_LEN`, less its NUL), and as `bpftool` and
    /// a map's info give it back: how a map that is not pinned is found by name.
    pub fn as_the_kernel_keeps(name: &str) -> &str {
        &name[..name.len().min(15)]
    }

    /// The translation of each fragmented datagram in flight, taken from its first fragment
    /// for the later ones, which carry no ports; an LRU, since a datagram lives milliseconds.
    /// Not pinned.
    pub const FRAGMENTS_V4: &str = "nat_fragments_v4";
    pub const FRAGMENTS_V6: &str = "nat_fragments_v6";
    /// The node's own ports (`node_ports`), which NAT never hands out; filled by the agent
    /// before the programs run, not pinned.
    pub const NODE_PORTS: &str = "node_ports";
    /// The ports of `node_ports`, laid out alike, on which no NAT entry can be found on the
    /// node's side, as the agent found: a packet of the node's own, or to it, on such a port
    /// has no entry to look up. Those the node holds (the kubelet's, an exporter's, inside NAT's
    /// spans), once a read of the table found no entry on them after they had been held long
    /// enough that no program could still give one out; the agent clears such a port's bit
    /// before it stops holding the port. And every port outside NAT's spans, once a read found
    /// no entry holding one on the node's side while no older table's flows were left to carry
    /// in: the programs make none there, so those bits stay. Not pinned.
    pub const ENTRYLESS_PORTS: &str = "entryless_ports";
    /// A sample of each NAT table's flows, by egress key, from which a full table picks the
    /// flows it drops early (`drop_sample_slots`); not pinned: the agent fills it from the
    /// table when it loads the programs.
    pub const DROP_SAMPLE_V4: &str = "nat_drop_sample_v4";
    pub const DROP_SAMPLE_V6: &str = "nat_drop_sample_v6";
    /// Per family, the slot of the drop sample a full table is freeing, for the new flow that
    /// takes the room; not pinned.
    pub const DROP_VACANCY: &str = "nat_drop_vacancy";
    /// Per CPU, the flow a new flow's port is searched for, handed to the search's global BPF
    /// function and back; not pinned.
    pub const PORT_REQUEST_V4: &str = "nat_port_request_v4";
    pub const PORT_REQUEST_V6: &str = "nat_port_request_v6";
    /// Per CPU, the IPv6 packet the programs' IPv6 parser (a global BPF function) parsed last;
    /// not pinned.
    pub const IPV6_WALK: &str = "ipv6_walk";
    /// What the agent asks of the sweep program (`SweepOrder`); written before each run, not
    /// pinned.
    pub const SWEEP_ORDER: &str = "nat_sweep_order";
    /// What the sweep program found, per family (`SweepReport`); not pinned.
    pub const SWEEP_REPORT: &str = "nat_sweep_report";

    /// Every map the agent pins.
    pub const PINNED: [&str; 18] = [
        NON_MASQ_V4,
        NON_MASQ_V6,
        NON_MASQ_SRC_V4,
        NON_MASQ_SRC_V6,
        DRAINING_V4,
        DRAINING_V6,
        NAT_V4,
        NAT_V6,
        NAT_SLOTS_V4,
        NAT_SLOT_WORDS_V4,
        NAT_SLOTS_V6,
        NAT_SLOT_WORDS_V6,
        INTERFACES,
        INTERFACES_BY_IFINDEX,
        SETTINGS,
        COUNTERS,
        POLICY_GENERATION,
        DECISIONS,
    ];
}

/// Names of the programs in the object.
pub mod program_names {
    pub const EGRESS: &str = "masq_egress";
    pub const INGRESS: &str = "masq_ingress";
    /// The NAT sweep, which the agent runs through BPF_PROG_TEST_RUN where the kernel has
    /// `bpf_for_each_map_elem` (5.13); never attached.
    pub const SWEEP: &str = "masq_sweep";
    /// Reads the kernel's tick count and CLOCK_MONOTONIC into `TickClock`'s probe fields, which
    /// the agent runs through BPF_PROG_TEST_RUN to measure the tick; never attached.
    pub const CLOCK_PROBE: &str = "masq_clock_probe";

    /// The helper the sweep program is built on (5.13): a kernel without it refuses the
    /// program, which is then not loaded, and the agent sweeps in userspace.
    #[cfg(feature = "user")]
    pub const SWEEP_NEEDS: aya::sys::BpfHelper = aya::sys::BpfHelper::BPF_FUNC_for_each_map_elem;

    /// The helper `program` is built on that the running kernel lacks, if any: such a program
    /// is not loaded. The data plane's own programs load everywhere the agent runs its eBPF
    /// plane.
    #[cfg(feature = "user")]
    pub fn missing_helper(program: &str) -> Option<aya::sys::BpfHelper> {
        let has = |helper| {
            aya::sys::is_helper_supported(aya::programs::ProgramType::SchedClassifier, helper)
                .unwrap_or(false)
        };
        (program == SWEEP && !has(SWEEP_NEEDS)).then_some(SWEEP_NEEDS)
    }
}

/// The node's own ports, a bit each, by protocol: those its sockets listen on, and kube-proxy's
/// NodePort range. NAT never hands them out, so the node's flows on them need no reservation in
/// the NAT table: replies to an inbound connection, or a flood of them, take no entry.
pub mod node_ports {
    use super::{IPPROTO_TCP, IPPROTO_UDP};

    /// 64-bit words per protocol: a bit for each of the 65 536 ports.
    pub const WORDS_PER_PROTOCOL: u32 = 1024;
    /// The map's entries: TCP's words, then UDP's.
    pub const WORDS: u32 = 2 * WORDS_PER_PROTOCOL;

    /// The word and the bit of `port` (host byte order) of `proto`; `None` for a protocol
    /// without ports.
    #[inline(always)]
    pub const fn slot(proto: u8, port: u16) -> Option<(u32, u64)> {
        let base = match proto {
            IPPROTO_TCP => 0,
            IPPROTO_UDP => WORDS_PER_PROTOCOL,
            _ => return None,
        };
        Some((base + (port as u32 >> 6), 1u64 << (port & 63)))
    }
}

/// Read-only globals the agent sets when it loads the object (`EbpfLoader::override_global`): the
/// verifier reads them as constants, and never walks the branches they rule out, so that one
/// object runs on kernels with and without a feature.
pub mod global_names {
    /// 1 where the kernel has `bpf_ktime_get_coarse_ns` (5.11): where the agent did not measure
    /// the tick (`TickClock`), flows are stamped with the tick-precise clock, which costs less
    /// per packet than the precise one every kernel has. Both read CLOCK_MONOTONIC.
    pub const COARSE_CLOCK: &str = "MASQ_COARSE_CLOCK";
    /// `drop_sample_slots` of each family's table: a constant for the verifier, so that a
    /// random slot needs no bounds check of its own.
    pub const DROP_SAMPLE_SLOTS_V4: &str = "MASQ_DROP_SAMPLE_SLOTS_V4";
    pub const DROP_SAMPLE_SLOTS_V6: &str = "MASQ_DROP_SAMPLE_SLOTS_V6";
    /// Each family's slot table's buckets (`slot_table::buckets_for`): a constant for the
    /// verifier, which follows only the way `Place::of` reduces a hash to this many.
    pub const SLOT_BUCKETS_V4: &str = "MASQ_SLOT_BUCKETS_V4";
    pub const SLOT_BUCKETS_V6: &str = "MASQ_SLOT_BUCKETS_V6";
    /// Each family's slot table's seed (`slot_table::seed_at`, where the table keeps it too):
    /// read with the buckets, on a line every packet reads.
    pub const SLOT_SEED_V4: &str = "MASQ_SLOT_SEED_V4";
    pub const SLOT_SEED_V6: &str = "MASQ_SLOT_SEED_V6";
    /// 1 where the CPU makes every store seen in the order it was made (x86's total store
    /// order): there a plain store publishes a slot the slot table's insert wrote, where other
    /// CPUs need a locked instruction, which waits for the slot's cache line (`SlotMemory::
    /// publish`).
    pub const STORES_IN_ORDER: &str = "MASQ_STORES_IN_ORDER";
}

/// The section of `TickClock`, a writable global of the programs' that the loader makes a map of
/// its own, named after it: the agent writes it once it has measured the tick, before the
/// programs are attached.
pub const TICK_CLOCK_SECTION: &str = ".data.masq_tick_clock";

/// How the programs stamp entries with CLOCK_MONOTONIC from the kernel's tick count (`jiffies`),
/// a load the verifier writes in place of `bpf_jiffies64`'s call, where the kernel's clocks
/// take a helper call each packet. The agent measures the tick when it loads the programs
/// (`program_names::CLOCK_PROBE`); until it has, and where it could not, `tick_ns` is 0 and
/// the programs read the kernel's clock (`global_names::COARSE_CLOCK`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickClock {
    /// Nanoseconds a tick.
    pub tick_ns: u64,
    /// CLOCK_MONOTONIC at tick 0, wrapping: a stamp is `jiffies * tick_ns + base_ns`.
    pub base_ns: u64,
    /// The probe's reading: the tick count, then CLOCK_MONOTONIC.
    pub probe_ticks: u64,
    pub probe_monotonic_ns: u64,
}

impl TickClock {
    /// CLOCK_MONOTONIC at the start of tick `ticks`, as far as the programs know it.
    #[inline(always)]
    pub const fn at(&self, ticks: u64) -> u64 {
        ticks.wrapping_mul(self.tick_ns).wrapping_add(self.base_ns)
    }
}

/// Capacity of each non-masquerade trie. Upstream caps a config at 64 CIDRs (`cidrLimit`), but the
/// cap is configurable and a trie costs nothing until used, so leave room for large policies.
pub const NON_MASQ_MAX_ENTRIES: u32 = 262_144;
/// Default NAT table size in entries; each flow takes two (one per direction).
pub const NAT_DEFAULT_ENTRIES: u32 = 2 * 262_144;
/// How often at most the programs refresh a NAT entry's `last_seen_ns`, to keep per-packet
/// writes to shared cache lines rare: an entry's time lags its flow's last packet by up to this
/// much, which the agent's sweep allows for. Expiry works in seconds to hours, so this costs no
/// precision that matters.
pub const LAST_SEEN_REFRESH_NS: u64 = 1_000_000_000;
/// How often the agent sweeps the NAT tables for flows that are over: how long past its timeout
/// a flow may keep its entries, and how stale a full table's drop sample may grow. Sweeps start
/// no closer together than this, the first as the agent starts.
pub const NAT_SWEEP_INTERVAL_SECS: u64 = 10;
/// The counters a full NAT table moves: flows it dropped early, and packets of new flows it
/// refused.
pub const FULL_TABLE_COUNTERS: [Counter; 3] = [
    Counter::NatEarlyDropped,
    Counter::NatNodeFlowDropped,
    Counter::DropNatTableFull,
];
/// Interfaces the programs may be attached to at once.
pub const INTERFACES_MAX_ENTRIES: u32 = 64;
/// Ifindexes below this have their device in `interfaces_by_ifindex` too. A node's uplinks are
/// made at boot, or by its network plugin soon after, and get small ifindexes; a device with a
/// larger one is read from the hash table alone.
pub const INTERFACES_BY_IFINDEX_ENTRIES: u32 = 1024;

/// What a prefix of the policy tries does to traffic to the destinations it is the longest
/// prefix of.
pub type PrefixAction = u8;

pub mod prefix_action {
    use super::PrefixAction;
    /// The pod's address is kept.
    pub const NON_MASQUERADE: PrefixAction = 1;
    /// Masqueraded: an exception inside a shorter non-masquerade prefix (`masqueradeCIDRs`).
    pub const MASQUERADE: PrefixAction = 2;
}

/// The value of each prefix in the policy tries (`non_masq_v4`, `non_masq_v6`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyEntry {
    /// The slot of `policy_decisions` that counts this prefix's decisions.
    pub counted_in: u32,
    pub action: PrefixAction,
    pub _pad: [u8; 3],
}

/// Slots of the `policy_decisions` array.
pub mod decision_slot {
    /// Counts the decisions no prefix took: destinations masqueraded by default.
    pub const BY_DEFAULT: u32 = 0;
    /// An entry's value when the array had no slot left for it: its decisions go uncounted.
    /// Never a slot: the array is never this large.
    pub const UNCOUNTED: u32 = u32::MAX;
    /// The fewest slots the agent gives the array: a few kilobytes per CPU, room for any policy
    /// of upstream's default `cidrLimit` to grow in.
    pub const AT_LEAST: u32 = 1024;
}

/// What the policy tries say of a destination: whether it keeps the pod's address, and which
/// slot of `policy_decisions` counts the entry that said so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub keeps_address: bool,
    pub counted_in: u32,
}

impl Decision {
    /// What an entry of the trie decides; `None`, no entry, means masquerade.
    #[inline(always)]
    pub fn of(entry: Option<&PolicyEntry>) -> Decision {
        match entry {
            Some(entry) => Decision {
                keeps_address: entry.action == prefix_action::NON_MASQUERADE,
                counted_in: entry.counted_in,
            },
            None => Decision {
                keeps_address: false,
                counted_in: decision_slot::BY_DEFAULT,
            },
        }
    }
}

/// Slots of the per-CPU verdict cache in front of `non_masq_v4`: direct-mapped by a hash of the
/// destination.
pub const NON_MASQ_CACHE_SLOTS: u32 = 4096;
/// Slots of the per-CPU verdict cache in front of `non_masq_v6`: each twice IPv4's size, so
/// half as many, the same memory a CPU.
pub const NON_MASQ_CACHE_SLOTS_V6: u32 = NON_MASQ_CACHE_SLOTS / 2;

/// The word of `map_names::POLICY_GENERATION`: the generation in its low bits, and a flag.
pub mod policy_word {
    /// Set by the agent once it has checked that no flow holds a NAT entry toward a destination
    /// the policy now leaves alone (one that outlived the policy it started under). Until a
    /// policy change clears it, a packet to or from such an address has no flow to find, and
    /// the programs skip the NAT table, whose lookup that misses reads a cold bucket.
    pub const STRAYS_CLEARED: u32 = 1 << 31;
    /// The generation's bits.
    pub const GENERATION_MASK: u32 = !STRAYS_CLEARED;

    /// Whether `word` has `STRAYS_CLEARED` set.
    #[inline(always)]
    pub const fn strays_cleared(word: u32) -> bool {
        word & STRAYS_CLEARED != 0
    }
}

/// The verdict caches' slots. IPv4's: `tag`, one word read and written whole, holds the
/// destination in its high 32 bits, the policy generation (31 bits) above the lowest bit, and
/// the verdict (1: not masqueraded) in the lowest bit. Generation 0 means "no policy yet", so that an empty
/// slot never matches. `counted_in` is the deciding entry's slot of `policy_decisions`: read
/// apart from the tag, so that a program preempted between the two writes can at worst count
/// one decision in the wrong slot, and never take a wrong verdict.
pub mod verdict_slot {
    pub use super::policy_word::GENERATION_MASK;

    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Slot {
        pub tag: u64,
        pub counted_in: u32,
        pub _pad: u32,
    }

    /// The slot's tag without its verdict bit, for `addr` under `generation`.
    #[inline(always)]
    pub const fn tag(addr: [u8; 4], generation: u32) -> u64 {
        tagged(u32::from_be_bytes(addr), generation)
    }

    #[inline(always)]
    pub const fn index(addr: [u8; 4]) -> u32 {
        slot_of(u32::from_be_bytes(addr), super::NON_MASQ_CACHE_SLOTS)
    }

    /// A tag without its verdict bit: `high` (IPv4's destination, or 32 bits of IPv6's hash)
    /// above the generation.
    #[inline(always)]
    const fn tagged(high: u32, generation: u32) -> u64 {
        ((high as u64) << 32) | (((generation & GENERATION_MASK) as u64) << 1)
    }

    /// The slot of `slots` (a power of two) that `word` of a destination hashes to.
    #[inline(always)]
    const fn slot_of(word: u32, slots: u32) -> u32 {
        word.wrapping_mul(0x9e37_79b1) >> (32 - slots.trailing_zeros())
    }

    /// IPv6's slot: the destination does not fit the tag beside the generation, so the slot
    /// holds it whole beside IPv4's slot, whose tag holds 32 bits of its hash (`hash_v6`) where
    /// IPv4's holds the address. A slot whose address and tag came from two writers (a program
    /// preempted between the two writes) is taken for neither destination but where their
    /// hashes' tag bits are equal: a chance of about one in 2^32 for two destinations that
    /// share the slot, whose index is the hash's other bits.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct SlotV6 {
        pub addr: [u8; 16],
        pub verdict: Slot,
    }

    /// The odd multipliers of an IPv6 destination's halves in `hash_v6`.
    pub const HASH_HIGH: u64 = 0x9e37_79b9_7f4a_7c15;
    pub const HASH_LOW: u64 = 0xc2b2_ae3d_27d4_eb4f;

    /// A hash of an IPv6 destination whose every bit depends on every bit of the address: its
    /// halves multiplied, then murmur3's finish. An xor of its words would be the same for
    /// addresses that differ by the same bits in two words (a pod prefix's node and pod
    /// numbers), which would share a slot and its tag.
    #[inline(always)]
    pub const fn hash_v6(addr: [u8; 16]) -> u64 {
        let [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = addr;
        let high = u64::from_ne_bytes([a, b, c, d, e, f, g, h]);
        let low = u64::from_ne_bytes([i, j, k, l, m, n, o, p]);
        let mut h = high.wrapping_mul(HASH_HIGH) ^ low.wrapping_mul(HASH_LOW);
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }

    /// IPv6's tag without its verdict bit, for `addr` under `generation`: the hash's low half.
    #[inline(always)]
    pub const fn tag_v6(addr: [u8; 16], generation: u32) -> u64 {
        tagged(hash_v6(addr) as u32, generation)
    }

    /// IPv6's slot: by the hash's high half, apart from the tag's bits.
    #[inline(always)]
    pub const fn index_v6(addr: [u8; 16]) -> u32 {
        slot_of((hash_v6(addr) >> 32) as u32, super::NON_MASQ_CACHE_SLOTS_V6)
    }

    /// The generation after `generation`, skipping 0.
    pub const fn next(generation: u32) -> u32 {
        match generation.wrapping_add(1) & GENERATION_MASK {
            0 => 1,
            next => next,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn every_destination_has_a_slot_and_its_tag_says_the_generation() {
            for addr in [[0; 16], [0xff; 16], *b"\x20\x01\x0d\xb8abcdefghijkl"] {
                assert!(index_v6(addr) < crate::NON_MASQ_CACHE_SLOTS_V6);
                // An empty slot's tag, 0, is no tag of a generation in force.
                assert_ne!(tag_v6(addr, 1), 0);
                assert_ne!(tag_v6(addr, 1), tag_v6(addr, next(1)));
                assert_eq!(tag_v6(addr, 7) & 1, 0, "the verdict's bit is left clear");
            }
            assert!(index([255; 4]) < crate::NON_MASQ_CACHE_SLOTS);
            assert_eq!(tag([10, 0, 0, 1], 3), 0x0a00_0001_0000_0006);
            assert_eq!(next(GENERATION_MASK), 1, "0 is skipped");
        }
    }
}

/// An Ethernet header's length, and the EtherTypes of the families.
pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;

/// An address as the maps hold it: `[u8; 4]` for IPv4, `[u8; 16]` for IPv6, in network order.
/// The NAT table's key and entry types are written once, over this.
pub trait Address:
    Copy + Default + Eq + core::hash::Hash + core::fmt::Debug + AsRef<[u8]> + AsMut<[u8]>
{
    /// Bits in the address: the LPM key length of a host.
    const BITS: u32;
    /// The bytes that round a `NatEntry` of this address up to its alignment, declared so that
    /// every byte the kernel copies is defined.
    type EntryPad: Copy + Default + Eq + core::hash::Hash + core::fmt::Debug;
}

impl Address for [u8; 4] {
    const BITS: u32 = 32;
    type EntryPad = [u8; 0];
}

impl Address for [u8; 16] {
    const BITS: u32 = 128;
    type EntryPad = [u8; 4];
}

/// The TCP header's flag bits, as on the wire.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

/// Which way a NAT table entry translates.
pub mod direction {
    /// Keyed by the packet as the pod sent it; rewrites the source.
    pub const EGRESS: u8 = 0;
    /// Keyed by the packet as the outside sends it back; rewrites the destination.
    pub const INGRESS: u8 = 1;
}

/// A flow as seen in one direction. Addresses and ports are in network byte order, exactly as
/// they appear in the packet. For ICMP echo, the identifier takes the place of the pod-side port
/// (`sport` on egress, `dport` on ingress) and the other port is 0.
///
/// Aligned to a u32, which its size is a multiple of (no field moves for it): the slot table
/// hashes and compares a key a u32 at a time (`slot_table::key_word`), where its fields'
/// alignment alone allowed a u16. Not to a u64, which would take one load a word: the padding
/// that aligns keys on the stack takes `masq_egress`'s deepest chain of frames past 512 bytes.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatKey<A> {
    pub saddr: A,
    pub daddr: A,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub direction: u8,
    pub _pad: [u8; 2],
}

pub type NatKeyV4 = NatKey<[u8; 4]>;
pub type NatKeyV6 = NatKey<[u8; 16]>;

impl<A: Address> NatKey<A> {
    /// The key of the other half of the same flow, given this half's entry. An egress half
    /// rewrites the source to `(addr, port)`, so replies arrive addressed to it; an ingress half
    /// rewrites the destination back to `(addr, port)`, where the pod's packets come from.
    pub fn reverse(&self, entry: &NatEntry<A>) -> NatKey<A> {
        if self.direction == direction::EGRESS {
            NatKey {
                saddr: self.daddr,
                daddr: entry.addr,
                sport: self.dport,
                dport: entry.port,
                proto: self.proto,
                direction: direction::INGRESS,
                _pad: [0; 2],
            }
        } else {
            NatKey {
                saddr: entry.addr,
                daddr: self.saddr,
                sport: entry.port,
                dport: self.sport,
                proto: self.proto,
                direction: direction::EGRESS,
                _pad: [0; 2],
            }
        }
    }
}

/// What to do with a flow's packets in one direction.
pub mod nat_kind {
    /// Rewrite to `(addr, port)`.
    pub const SNAT: u8 = 1;
    /// A connection opened from outside toward a pod: never rewrite. `(addr, port)` hold the
    /// packet's own values, so `reverse` finds the other half like for SNAT entries.
    pub const PASSTHROUGH: u8 = 2;
    /// A flow of the node's own address that nothing here translates (a node socket's, or one
    /// netfilter masqueraded, kube-proxy's say): never rewrite, but its tuple on the node's
    /// address is held, so that no masqueraded flow is given the same. Identity entries, as
    /// for `PASSTHROUGH`.
    pub const NODE: u8 = 3;
}

/// What a flow's half saw of TCP, for expiry and for judging RSTs: bits of its own, not the
/// header's flags (those are `tcp_flags`).
pub mod tcp_seen {
    /// A segment with SYN: the handshake's first step (or its answer).
    pub const OPENING: u8 = 1 << 0;
    /// A segment without SYN: the handshake got past its first step.
    pub const PAST_OPENING: u8 = 1 << 1;
    /// A segment with FIN.
    pub const CLOSING: u8 = 1 << 2;
    /// An acceptable RST (see `NatEntry::tcp_next_seq`): the connection is over.
    pub const RESET: u8 = 1 << 3;
    /// A segment with ACK: `NatEntry::tcp_max_ack` holds an acknowledgment number.
    pub const ACKED: u8 = 1 << 4;
    /// `NatEntry::tcp_next_seq` holds a sequence number: every segment sets it, but a half an
    /// older agent created (before entries recorded sequence numbers) has flags without it.
    pub const SEQ: u8 = 1 << 5;
}

/// Whether a flow is one conntrack counts as assured, and so never drops early to make room: TCP
/// past its handshake both ways and not reset; another protocol seen both ways again after its
/// first exchange (a stream). `egress` and `ingress` are its halves' `tcp_seen` bytes.
#[inline(always)]
pub const fn is_assured(proto: u8, egress: u8, ingress: u8) -> bool {
    if proto == IPPROTO_TCP {
        let seen = egress | ingress;
        egress != 0
            && ingress != 0
            && seen & tcp_seen::PAST_OPENING != 0
            && seen & tcp_seen::RESET == 0
    } else {
        egress & packets_seen::ONCE != 0 && ingress & packets_seen::AGAIN != 0
    }
}

/// Whether a full NAT table may drop a flow to make room for a new one, as conntrack may: a flow
/// it would not count as assured, or a TCP connection that is closing or reset, which
/// conntrack's collector drops from a table past 95 % full (`tcp_can_early_drop`: FIN_WAIT,
/// CLOSE_WAIT, LAST_ACK, TIME_WAIT, CLOSE). `egress` and `ingress` are its halves' `tcp_seen`.
#[inline(always)]
pub const fn can_drop_early(proto: u8, egress: u8, ingress: u8) -> bool {
    let ending = tcp_seen::CLOSING | tcp_seen::RESET;
    !is_assured(proto, egress, ingress)
        || (proto == IPPROTO_TCP && (egress | ingress) & ending != 0)
}

/// Whether a full NAT table may drop the flow whose egress half is of `kind`: a flow of the
/// node's own (`nat_kind::NODE`), a reservation its next packet makes again, whatever its
/// state; any other as `can_drop_early` says. `egress` and `ingress` are its halves'
/// `tcp_seen`.
#[inline(always)]
pub const fn may_drop_from_full_table(kind: u8, proto: u8, egress: u8, ingress: u8) -> bool {
    kind == nat_kind::NODE || can_drop_early(proto, egress, ingress)
}

/// Each family's slot of the map `nat_drop_vacancy` (`map_names::DROP_VACANCY`).
/// Each word holds a slot of the drop sample plus one: 0 names none.
pub mod drop_vacancy {
    pub const V4: u32 = 0;
    pub const V6: u32 = 1;

    /// The word that names no slot.
    pub const NONE: u32 = 0;

    /// The word that names `slot`.
    #[inline(always)]
    pub const fn naming(slot: u32) -> u32 {
        slot + 1
    }

    /// The slot `word` names, if any.
    #[inline(always)]
    pub const fn named(word: u32) -> Option<u32> {
        word.checked_sub(1)
    }
}

/// Slots of a family's drop sample for a NAT table of `nat_entries` entries: one per flow the
/// table holds (two entries each), rounded up to a power of two, so that a random slot is a
/// mask away. Each new flow writes its egress key into a random slot; a full table looks at
/// `EARLY_DROP_PROBES` slots for a flow to drop. Sized to the table, the sample stays
/// dense with whatever fills it, however large the table is.
pub const fn drop_sample_slots(nat_entries: u32) -> u32 {
    let flows = nat_entries / 2;
    if flows <= 1 {
        1
    } else {
        flows.next_power_of_two()
    }
}

/// Slots of the drop sample, in a row from a random one, that a full table looks at for the
/// flow to drop (the first that is finished, else the one idle longest of those it may drop),
/// where conntrack looks at 8
/// buckets of its table in a row. A bucket holds several
/// entries and a slot one, and a sample that new flows filled at random slots leaves about a
/// third of them empty (each new flow writes one, and some write the same). In a table of
/// closed connections and one open one, 8 slots in a row all miss once in some 2 500 new flows
/// (a pod closing 150 connections in a 64-flow table was refused one, once); 16 once in six
/// million, and a round that finds none is followed by another (`EARLY_DROP_ROUNDS`). The
/// slots are walked in one global BPF function, and each slot's flow judged in another, each
/// of which the verifier walks once: a slot costs it a call and a comparison.
pub const EARLY_DROP_PROBES: u32 = 16;

/// How many rounds of early drop a new flow may take in a full table before it is dropped
/// itself. A round drops one flow, or finds none in its `EARLY_DROP_PROBES` slots, or loses the
/// flow it chose to another CPU that took it first; either way the next looks again, at other
/// slots (`early_drop::EarlyDrop::NOTHING_DROPPED`). The room one flow makes can be taken by
/// another CPU's new flow before this one takes it, as nothing reserves it, and then another
/// flow makes room again. With two rounds, four threads of new flows into a full table on two
/// CPUs still lost one flow in about four runs of the flood test; with four, none in twelve,
/// but a full CI run still lost one in some 1 300 drops to a pod's query churn on two CPUs:
/// both CPUs choose the flow idle longest, often the same one, and the loser looks again. With
/// eight, a loss needs eight lost rounds in a row. A table full of flows it may not drop costs
/// each new flow's packet all eight rounds, 128 lookups. The rounds cost the verifier little:
/// each is a call of `early_drop`'s global function, which it walks once, not once per round.
pub const EARLY_DROP_ROUNDS: u32 = 8;

/// For protocols other than TCP, the packets a half saw after the flow's first, in
/// `NatEntry::tcp_seen`'s two high bits (which TCP's leaves clear): enough to tell a flow never
/// answered, or answered once, from a stream, as conntrack times UDP. Each is written once in
/// a flow's life.
pub mod packets_seen {
    /// One packet crossed the half (on the egress half: one after the flow's first).
    pub const ONCE: u8 = 1 << 6;
    /// Another.
    pub const AGAIN: u8 = 1 << 7;
}

/// One half of a translated flow.
///
/// For TCP, each half also holds where its sender stands in the sequence space, so that an RST
/// ends the flow only when the receiving end would accept it, as conntrack decides (RFC 5961
/// §3): its sequence number is the highest acknowledgment the other half sent, or it follows
/// right after its own sender's last segment; before the other half acknowledged anything, it
/// must acknowledge the other half's SYN. A blind RST from outside leaves the flow as it was.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatEntry<A: Address> {
    /// CLOCK_MONOTONIC of the last packet, at tick precision (`TickClock`), refreshed at most
    /// once a second.
    pub last_seen_ns: u64,
    pub addr: A,
    pub port: u16,
    pub kind: u8,
    /// `tcp_seen` bits of the packets sent this way; 0 until the first one. For other protocols,
    /// `packets_seen` bits.
    pub tcp_seen: u8,
    /// TCP: the sequence number after the furthest segment sent this way (host byte order).
    pub tcp_next_seq: u32,
    /// TCP: the highest acknowledgment number sent this way, once `tcp_seen::ACKED`.
    pub tcp_max_ack: u32,
    pub _pad: A::EntryPad,
}

pub type NatEntryV4 = NatEntry<[u8; 4]>;
pub type NatEntryV6 = NatEntry<[u8; 16]>;

/// A fragmented datagram, as its fragments carry it: the IP header's addresses, identification
/// and protocol, and the direction it crosses the node in.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragmentKey<A> {
    pub saddr: A,
    pub daddr: A,
    /// As the header carries it, in network byte order: IPv4's 16 bits widened, IPv6's 32.
    pub id: u32,
    pub proto: u8,
    pub direction: u8,
    pub _pad: [u8; 2],
}

/// Datagrams whose fragments can be in flight at once.
pub const FRAGMENTS_MAX_ENTRIES: u32 = 16_384;

/// An interface the programs are attached to, keyed by ifindex: the addresses masqueraded
/// packets leave it with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    /// The primary IPv4 address.
    pub ipv4: [u8; 4],
    /// The first global IPv6 address; all zeros (`::`) when IPv6 is not masqueraded here.
    pub ipv6: [u8; 16],
    /// The address a pod's masqueraded flow takes instead of `ipv4` (`masqueradeAddress`,
    /// while the node holds it); all zeros: `ipv4`. It is the node's as `ipv4` is: the node's
    /// own flows from either keep their address.
    pub masquerade_ipv4: [u8; 4],
    /// The same for IPv6 (`masqueradeAddressIPv6`).
    pub masquerade_ipv6: [u8; 16],
}

/// An element of `interfaces_by_ifindex`. The agent rewrites one only while `in_use` is clear
/// and no program run that saw it set is still running (an RCU grace period, which tc programs
/// run inside), so that a program that finds it set reads an `iface` no write is changing, and
/// one that finds it clear reads the hash table instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexedInterface {
    /// Not 0: `iface` is the device's, as in `interfaces`.
    pub in_use: u32,
    pub iface: Interface,
}

pub const MAX_PORT_SPANS: usize = 8;

/// `first..first + count` in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortSpan {
    pub first: u32,
    pub count: u32,
}

/// Translation settings, in slot 0 of the `settings` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// The ports NAT may hand out, as disjoint spans.
    pub spans: [PortSpan; MAX_PORT_SPANS],
    pub span_count: u32,
    /// Sum of the spans' counts; 0 means NAT is not configured yet and nothing is translated.
    pub total_ports: u32,
    /// 1: pick ports at random (`--random-fully`); 0: keep the pod's port when it is free.
    pub random_fully: u32,
    /// The families whose sources the policy decides too (`sources_decided`): their
    /// `non_masq_src` trie holds entries. Set after the trie is filled, cleared before it is
    /// emptied, so that a family without source entries pays no lookup.
    pub sources_decided: u32,
}

/// The bits of `Settings::sources_decided`.
pub mod sources_decided {
    pub const V4: u32 = 1;
    pub const V6: u32 = 2;
}

/// Declares the counters once: each variant, its slot (in order), and its stable name.
macro_rules! counters {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:literal in $metric:expr $(, $label:ident = $value:literal)?;
    )*) => {
        /// Per-CPU packet counters, one slot each in the `counters` array.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $variant,)*
        }

        impl Counter {
            pub const ALL: [Counter; [$(Counter::$variant),*].len()] = [$(Counter::$variant),*];

            /// Stable name, as `status` lists the counter.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }

            /// The metric the agent exports the counter under, and the label that tells it
            /// apart there when the metric has more than it.
            #[cfg(feature = "user")]
            pub const fn series(self) -> (CounterMetric, Option<(&'static str, &'static str)>) {
                match self {
                    $(Counter::$variant => ($metric, counters!(@label $($label = $value)?)),)*
                }
            }
        }
    };
    (@label) => { None };
    (@label $label:ident = $value:literal) => { Some((stringify!($label), $value)) };
}

/// A metric the agent exports counters under: its name (the agent adds its prefix, and
/// `_total`) and its help.
#[cfg(feature = "user")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterMetric {
    pub name: &'static str,
    pub help: &'static str,
}

#[cfg(feature = "user")]
impl CounterMetric {
    const fn of(name: &'static str, help: &'static str) -> CounterMetric {
        CounterMetric { name, help }
    }
}

/// The metrics several counters share, each counter under a label of its own.
#[cfg(feature = "user")]
const NOT_MASQUERADED: CounterMetric = CounterMetric::of(
    "packets_not_masqueraded",
    "Egress packets left with their source address, by reason",
);
#[cfg(feature = "user")]
const DROPPED: CounterMetric = CounterMetric::of(
    "packets_dropped",
    "Packets the data plane dropped, by reason",
);
#[cfg(feature = "user")]
const REVERSED: CounterMetric = CounterMetric::of(
    "packets_reverse_translated",
    "Ingress packets given back the pod's address, by kind",
);

counters! {
    /// Egress packets whose source was rewritten.
    Masqueraded = "masqueraded" in CounterMetric::of(
        "packets_masqueraded",
        "Egress packets whose source became the node's address",
    );
    /// Egress packets to a destination in the non-masquerade tries.
    NotMasqNonMasqDestination = "not_masqueraded_non_masq_destination"
        in NOT_MASQUERADED, reason = "non_masq_destination";
    /// Egress packets from the interface's own address: the node's own traffic.
    NotMasqNodeSource = "not_masqueraded_node_source" in NOT_MASQUERADED, reason = "node_source";
    /// Egress packets of protocols left to the iptables chain.
    NotMasqOtherProtocol = "not_masqueraded_other_protocol"
        in NOT_MASQUERADED, reason = "other_protocol";
    /// Egress packets of connections opened from outside toward a pod, or that started
    /// unmasqueraded before their destination was removed from the non-masquerade CIDRs.
    NotMasqInbound = "not_masqueraded_inbound_connection"
        in NOT_MASQUERADED, reason = "inbound_connection";
    /// Egress packets from a source the policy leaves alone (`nonMasqueradeSrcCIDRs`), toward
    /// a destination it would masquerade.
    NotMasqNonMasqSource = "not_masqueraded_non_masq_source"
        in NOT_MASQUERADED, reason = "non_masq_source";
    /// Egress ICMP other than echo requests (replies and errors about inbound flows).
    NotMasqIcmpOther = "not_masqueraded_icmp_other" in NOT_MASQUERADED, reason = "icmp_other";
    /// Ingress packets whose destination was restored.
    ReverseTranslated = "reverse_translated" in REVERSED, kind = "reply";
    /// Ingress ICMP errors about masqueraded flows, translated inside and out.
    IcmpErrorTranslated = "icmp_error_translated" in REVERSED, kind = "icmp_error";
    /// Egress ICMP errors about masqueraded flows (a pod's, or the node's own about a packet
    /// it restored), translated inside and out, as conntrack translates a RELATED error.
    IcmpErrorMasqueraded = "icmp_error_masqueraded" in CounterMetric::of(
        "icmp_errors_masqueraded",
        "Egress ICMP errors about masqueraded flows, translated inside and out as conntrack translates a related error",
    );
    /// TCP RSTs whose sequence number the receiving end would not accept: passed on, but the
    /// flow keeps its state.
    TcpRstNotAcceptable = "tcp_rst_not_acceptable" in CounterMetric::of(
        "tcp_resets_not_acceptable",
        "TCP RSTs whose sequence number the receiving end would not accept; the flow keeps its state",
    );
    /// TCP FINs from outside whose sequence number lies far from what the receiving end
    /// acknowledged: passed on, but the flow keeps its state.
    TcpFinNotAcceptable = "tcp_fin_not_acceptable" in CounterMetric::of(
        "tcp_fins_not_acceptable",
        "TCP FINs from outside whose sequence number lies far from what the receiving end acknowledged; the flow keeps its state",
    );
    /// TCP connections opened again on the tuple of one that was over (reset, or closed both
    /// ways): the flow keeps its port and starts anew, as conntrack reopens a connection.
    TcpReopened = "tcp_reopened" in CounterMetric::of(
        "tcp_connections_reopened",
        "TCP connections opened again on the tuple of one that was over (reset, or closed both ways): the flow keeps its port and starts anew",
    );
    /// Flows of the node's own address (its sockets, or netfilter's NAT) whose tuple a
    /// masqueraded flow already held: given another port, as conntrack resolves a clash.
    NodePortClash = "node_port_clash" in CounterMetric::of(
        "node_port_clashes",
        "Flows of the node's own address (its sockets, or netfilter's NAT) whose tuple a masqueraded flow held: given another port, as conntrack resolves a clash",
    );
    /// Flows of a replaced NAT table (an upgrade, another `--nat-capacity`) that did not fit
    /// into the new one. Counted by the agent, not the programs.
    NatFlowsNotCarried = "nat_flows_not_carried" in CounterMetric::of(
        "nat_flows_not_carried",
        "Flows of a replaced NAT table (an upgrade, another --nat-capacity) that did not fit into the new one",
    );
    /// Connections opened from outside toward a pod, first seen.
    InboundTracked = "inbound_connection_tracked" in CounterMetric::of(
        "inbound_connections_tracked",
        "Connections opened from outside toward a pod, first seen",
    );
    /// Port allocations that found no free port.
    AllocationFailed = "allocation_failed" in CounterMetric::of(
        "nat_allocation_failures",
        "New flows for which no free NAT port was found",
    );
    /// Packets dropped: no free NAT port.
    DropPortsExhausted = "dropped_ports_exhausted" in DROPPED, reason = "ports_exhausted";
    /// Packets dropped: the NAT table is full, and none of the flows it looked at could go.
    DropNatTableFull = "dropped_nat_table_full" in DROPPED, reason = "nat_table_full";
    /// Flows dropped from a full NAT table to make room for a pod's new one, as conntrack drops
    /// early: never answered, not past their first exchange, or TCP connections closing; or
    /// over (idle past their timeout) before the sweep removed them.
    NatEarlyDropped = "nat_early_dropped" in CounterMetric::of(
        "nat_early_drops",
        "Flows dropped from a full NAT table to make room for a pod's new one, as conntrack drops early: never answered, not past their first exchange, or TCP connections closing; or over, idle past their timeout, before the sweep removed them",
    );
    /// Flows of the node's own address dropped from a full NAT table to make room for a pod's
    /// new one: reservations of its tuple, which its next packet makes again.
    NatNodeFlowDropped = "nat_node_flow_dropped" in CounterMetric::of(
        "nat_node_flow_drops",
        "Flows of the node's own address dropped from a full NAT table to make room for a pod's new one",
    );
    /// Packets dropped: IP fragments that cannot be translated.
    DropFragment = "dropped_fragment" in DROPPED, reason = "fragment";
    /// Packets dropped: a rewrite helper failed half-way, so the packet is not sent half-translated.
    DropRewriteFailed = "dropped_rewrite_failed" in DROPPED, reason = "rewrite_failed";
    /// Packets dropped: IPv6 from a pod whose extension headers run on past what the programs
    /// walk. The chain's protocol match walks any chain and would let it out untranslated.
    DropExtensionHeaders = "dropped_extension_headers" in DROPPED, reason = "extension_headers";
    /// Packets not inspected: neither IPv4 nor IPv6, too short or malformed, or NAT not
    /// configured for their family.
    NotInspected = "not_inspected" in CounterMetric::of(
        "packets_not_inspected",
        "Packets the programs passed without a look: not IP, malformed, or before the agent configured them",
    );
}

pub const COUNTER_SLOTS: u32 = Counter::ALL.len() as u32;

/// The layouts the kernel and the agent share, checked when either side builds, as Cilium's
/// `build_bug_on` checks its own: a field added, moved or resized fails the build here rather
/// than misreading a pinned map. An older agent's NAT entry layout is read by the agent's carry
/// of old tables, which must change with any change of these sizes.
mod layout {
    use core::mem::{align_of, offset_of, size_of};

    use super::{
        FragmentKey, Interface, MAX_PORT_SPANS, NatEntryV4, NatEntryV6, NatKeyV4, NatKeyV6,
        PolicyEntry, PortSpan, Settings, SweepOrder, SweepReport, node_ports, verdict_slot,
    };

    const _: () = assert!(size_of::<NatKeyV4>() == 16 && align_of::<NatKeyV4>() == 4);
    const _: () = assert!(size_of::<NatKeyV6>() == 40 && align_of::<NatKeyV6>() == 4);
    const _: () = assert!(offset_of!(NatKeyV4, sport) == 8 && offset_of!(NatKeyV4, proto) == 12);
    const _: () = assert!(offset_of!(NatKeyV6, sport) == 32 && offset_of!(NatKeyV6, proto) == 36);
    const _: () = assert!(size_of::<NatEntryV4>() == 24 && align_of::<NatEntryV4>() == 8);
    const _: () = assert!(size_of::<NatEntryV6>() == 40 && align_of::<NatEntryV6>() == 8);
    const _: () = assert!(offset_of!(NatEntryV4, tcp_next_seq) == 16);
    const _: () = assert!(offset_of!(NatEntryV6, tcp_next_seq) == 28);
    const _: () = assert!(size_of::<FragmentKey<[u8; 4]>>() == 16);
    const _: () = assert!(size_of::<FragmentKey<[u8; 16]>>() == 40);
    const _: () = assert!(size_of::<Interface>() == 40);
    const _: () = assert!(size_of::<PortSpan>() == 8);
    const _: () = assert!(size_of::<Settings>() == 8 * MAX_PORT_SPANS + 16);
    const _: () = assert!(size_of::<PolicyEntry>() == 8 && offset_of!(PolicyEntry, action) == 4);
    const _: () = assert!(size_of::<verdict_slot::Slot>() == 16);
    const _: () = assert!(size_of::<verdict_slot::SlotV6>() == 32);
    const _: () = assert!(size_of::<SweepOrder>() == 8 * 16);
    const _: () = assert!(size_of::<SweepReport>() == 8 * (10 + node_ports::WORDS as usize));
}

pub mod flows;
pub mod policy_index;
pub mod slot_table;
pub use flows::{FlowOwner, FlowState, SamplePointing, SweepOrder, SweepReport, sweep_report};

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)] plain data with explicit padding and no pointers.
    unsafe impl aya::Pod for super::NatKeyV4 {}
    unsafe impl aya::Pod for super::NatEntryV4 {}
    unsafe impl aya::Pod for super::NatKeyV6 {}
    unsafe impl aya::Pod for super::NatEntryV6 {}
    unsafe impl aya::Pod for super::Interface {}
    unsafe impl aya::Pod for super::IndexedInterface {}
    unsafe impl aya::Pod for super::Settings {}
    unsafe impl aya::Pod for super::PolicyEntry {}
    unsafe impl aya::Pod for super::SweepOrder {}
    unsafe impl aya::Pod for super::SweepReport {}
    unsafe impl aya::Pod for super::TickClock {}
}

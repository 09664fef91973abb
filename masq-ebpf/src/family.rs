//! What differs between IPv4 and IPv6 for the translation: header layout, the ICMP dialect,
//! the maps, and how an address rewrite keeps checksums right. Everything else (the decisions,
//! the NAT state, ports, fragments) is written once over `Family`.

use aya_ebpf::programs::TcContext;
use masq_ebpf::{
    Address, Decision, IPPROTO_ICMP, IPPROTO_ICMPV6, Interface, NatEntry, NatKey, sources_decided,
};

use crate::{
    csum::{self, AddrField, L4Checksum, Ports},
    early_drop, flow_table,
    maps::{
        self, DropSample, FragmentTable, NatTable, PolicyTrie, PortRequests, SlotArray, SlotWords,
    },
    nat,
    parse::{self, Packet},
    policy, sweep,
};

pub trait Family {
    type Addr: Address + 'static;
    /// The family's ICMP protocol number.
    const ICMP: u8;
    const ECHO_REQUEST: u8;
    const ECHO_REPLY: u8;
    /// ICMPv6's checksum covers the pseudo-header; ICMP's does not.
    const ICMP_PSEUDO_HEADER: bool;
    /// Where the length field sits in the IP header, and the header bytes it leaves out.
    const LEN_OFF: usize;
    const LEN_UNCOUNTED: usize;
    /// Where the addresses sit in the IP header.
    const SADDR_OFF: usize;
    const DADDR_OFF: usize;
    /// Where the header's own checksum sits; IPv6 has none.
    const IP_CSUM_OFF: Option<usize>;
    /// Whether the steps declared with `step!` run as functions of their own.
    const OWN_FRAMES: bool;
    /// The family's global BPF functions, which the verifier walks once each:
    /// `early_drop::early_drop`'s, its look at a flow and its drop of the one chosen, and
    /// `nat::search_port`'s.
    const EARLY_DROP: extern "C" fn(u64) -> i64;
    const DROP_RANK: extern "C" fn(u32, u64) -> i64;
    const DROP_RANKED: extern "C" fn(u32, i64, u64) -> i64;
    const RESERVE_PORT: extern "C" fn() -> i64;
    /// The family's global operations on the slot table (`flow_table`).
    const FIND_SLOT: extern "C" fn(*const NatKey<Self::Addr>) -> i64;
    const INSERT_SLOT: extern "C" fn(
        *const NatKey<Self::Addr>,
        *const NatEntry<Self::Addr>,
    ) -> i32;
    const REMOVE_SLOT: extern "C" fn(*const NatKey<Self::Addr>) -> i32;
    /// The sweep's `flow_table::read_ahead` (`Visit::before_buckets`).
    const SWEEP_AHEAD: extern "C" fn(u32) -> i64;
    /// The family's slot of `maps::DROP_VACANCY`.
    const DROP_VACANCY: u32;
    /// The family's slot of the sweep program's report (`masq_ebpf::sweep_report`).
    const SWEEP_REPORT: u32;
    /// Where `nat::request_port` leaves the flow for `RESERVE_PORT`.
    fn port_request() -> &'static PortRequests<Self::Addr>;

    /// Parses the IP header at `offset`: the packet's own, or one quoted in an ICMP error.
    fn parse_at(ctx: &TcContext, offset: usize) -> Option<Packet<Self::Addr>>;
    /// ICMP errors that quote the packet they are about.
    fn is_icmp_error(icmp_type: u8) -> bool;
    /// The address masqueraded packets leave `iface` with; `None` when there is none.
    fn node_addr(iface: &Interface) -> Option<Self::Addr>;
    /// The address chosen for the family's masqueraded flows, if the agent gave one.
    fn chosen_addr(iface: &Interface) -> Option<Self::Addr>;
    /// Whether `addr` is the chosen address, compared where it lies.
    fn is_chosen_addr(iface: &Interface, addr: &Self::Addr) -> bool;
    /// Whether a pod could be `addr`: replies to broadcast or multicast open no flow.
    fn is_unicast(addr: &Self::Addr) -> bool;
    fn nat() -> &'static NatTable<Self::Addr>;
    /// Whether the family's halves are in its slot table, a constant for the verifier.
    fn in_slot_table() -> bool;
    /// The family's slot table (where `in_slot_table`), and its buckets, an even number the
    /// agent set.
    fn slots() -> &'static SlotArray<Self::Addr>;
    fn slot_words() -> &'static SlotWords;
    fn slot_buckets() -> u32;
    /// The family's slot table's seed, which the agent set.
    fn slot_seed() -> u64;
    fn drop_sample() -> &'static DropSample<Self::Addr>;
    /// The drop sample's slots, a power of two the agent set.
    fn drop_sample_slots() -> u32;
    fn fragments() -> &'static FragmentTable<Self::Addr>;
    /// What the policy decides for traffic to `addr`.
    fn decide(addr: Self::Addr) -> Decision;
    #[inline(always)]
    fn is_non_masq_destination(addr: Self::Addr) -> bool {
        Self::decide(addr).keeps_address
    }
    fn is_draining_destination(addr: Self::Addr) -> bool;
    /// The family's source trie, and its bit of `Settings::sources_decided`.
    fn source_trie() -> &'static PolicyTrie<Self::Addr>;
    const SOURCES_DECIDED: u32;
    /// What the source lists decide for traffic from `addr`; `None` while the family has no
    /// source entry, which costs no lookup.
    #[inline(always)]
    fn decide_source(addr: Self::Addr) -> Option<Decision> {
        let decided =
            maps::settings().is_some_and(|s| s.sources_decided & Self::SOURCES_DECIDED != 0);
        decided.then(|| policy::decide(Self::source_trie(), addr))
    }
    /// Whether traffic from `saddr` to `daddr` keeps the pod's address, whichever says so.
    #[inline(always)]
    fn leaves_alone(saddr: Self::Addr, daddr: Self::Addr) -> bool {
        Self::is_non_masq_destination(daddr)
            || Self::decide_source(saddr).is_some_and(|d| d.keeps_address)
    }
    /// Where `field` sits in the IP header.
    #[inline(always)]
    fn addr_off(field: AddrField) -> usize {
        match field {
            AddrField::Source => Self::SADDR_OFF,
            AddrField::Destination => Self::DADDR_OFF,
        }
    }
    /// Rewrites one address of the outer header, with every checksum that covers it; the L4
    /// checksum at `l4_csum` if given, whose pseudo-header holds the address.
    #[inline(always)]
    fn rewrite_addr(
        ctx: &TcContext,
        ip: &Packet<Self::Addr>,
        field: AddrField,
        new: Self::Addr,
        l4_csum: Option<L4Checksum>,
    ) -> Result<(), i64> {
        Self::rewrite_addr_and_ports(ctx, ip, field, new, l4_csum, None).map(|_| ())
    }
    /// `rewrite_addr`, storing the TCP or UDP `ports` (their checksum already updated) with the
    /// address where the header lets one store take both; says whether it did.
    fn rewrite_addr_and_ports(
        ctx: &TcContext,
        ip: &Packet<Self::Addr>,
        field: AddrField,
        new: Self::Addr,
        l4_csum: Option<L4Checksum>,
        ports: Option<Ports>,
    ) -> Result<bool, i64>;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    type Addr = [u8; 4];
    const ICMP: u8 = IPPROTO_ICMP;
    const ECHO_REQUEST: u8 = parse::ICMP_ECHO_REQUEST;
    const ECHO_REPLY: u8 = parse::ICMP_ECHO_REPLY;
    const ICMP_PSEUDO_HEADER: bool = false;
    const LEN_OFF: usize = parse::IPV4_LEN_OFF;
    const LEN_UNCOUNTED: usize = 0;
    const SADDR_OFF: usize = parse::IPV4_SADDR_OFF;
    const DADDR_OFF: usize = parse::IPV4_DADDR_OFF;
    const IP_CSUM_OFF: Option<usize> = Some(parse::IPV4_CSUM_OFF);
    const OWN_FRAMES: bool = false;
    const EARLY_DROP: extern "C" fn(u64) -> i64 = early_drop::masq_early_drop_v4;
    const DROP_RANK: extern "C" fn(u32, u64) -> i64 = early_drop::masq_drop_rank_v4;
    const DROP_RANKED: extern "C" fn(u32, i64, u64) -> i64 = early_drop::masq_drop_ranked_v4;
    const RESERVE_PORT: extern "C" fn() -> i64 = nat::masq_reserve_port_v4;
    const FIND_SLOT: extern "C" fn(*const NatKey<[u8; 4]>) -> i64 = flow_table::masq_find_slot_v4;
    const INSERT_SLOT: extern "C" fn(*const NatKey<[u8; 4]>, *const NatEntry<[u8; 4]>) -> i32 =
        flow_table::masq_insert_slot_v4;
    const REMOVE_SLOT: extern "C" fn(*const NatKey<[u8; 4]>) -> i32 =
        flow_table::masq_remove_slot_v4;
    const SWEEP_AHEAD: extern "C" fn(u32) -> i64 = sweep::masq_sweep_ahead_v4;
    const DROP_VACANCY: u32 = masq_ebpf::drop_vacancy::V4;
    const SWEEP_REPORT: u32 = masq_ebpf::sweep_report::V4;

    #[inline(always)]
    fn port_request() -> &'static PortRequests<[u8; 4]> {
        &maps::PORT_REQUEST_V4
    }

    #[inline(always)]
    fn parse_at(ctx: &TcContext, offset: usize) -> Option<Packet<[u8; 4]>> {
        parse::ipv4_at(ctx, offset)
    }

    /// Destination unreachable, time exceeded and parameter problem.
    #[inline(always)]
    fn is_icmp_error(icmp_type: u8) -> bool {
        matches!(
            icmp_type,
            parse::ICMP_DEST_UNREACH | parse::ICMP_TIME_EXCEEDED | parse::ICMP_PARAMETER_PROBLEM
        )
    }

    #[inline(always)]
    fn node_addr(iface: &Interface) -> Option<[u8; 4]> {
        Some(iface.ipv4)
    }

    #[inline(always)]
    fn chosen_addr(iface: &Interface) -> Option<[u8; 4]> {
        (iface.masquerade_ipv4 != [0; 4]).then_some(iface.masquerade_ipv4)
    }

    #[inline(always)]
    fn is_chosen_addr(iface: &Interface, addr: &[u8; 4]) -> bool {
        iface.masquerade_ipv4 == *addr
    }

    /// Not multicast (224.0.0.0/4), the limited broadcast, nor link-local (169.254.0.0/16),
    /// which no pod is reached at from outside: on a shared segment, a neighbour's mDNS or
    /// DHCP would otherwise leave a flow behind for every port it sends from.
    #[inline(always)]
    fn is_unicast(addr: &[u8; 4]) -> bool {
        addr[0] & 0xf0 != 0xe0 && *addr != [255; 4] && !(addr[0] == 169 && addr[1] == 254)
    }

    #[inline(always)]
    fn nat() -> &'static NatTable<[u8; 4]> {
        &maps::NAT_V4
    }

    #[inline(always)]
    fn slots() -> &'static SlotArray<[u8; 4]> {
        &maps::NAT_SLOTS_V4
    }

    #[inline(always)]
    fn slot_words() -> &'static SlotWords {
        &maps::NAT_SLOT_WORDS_V4
    }

    #[inline(always)]
    fn slot_buckets() -> u32 {
        maps::set_by_agent(&maps::MASQ_SLOT_BUCKETS_V4)
    }

    #[inline(always)]
    fn slot_seed() -> u64 {
        maps::set_by_agent(&maps::MASQ_SLOT_SEED_V4)
    }

    #[inline(always)]
    fn in_slot_table() -> bool {
        maps::in_slot_table()
    }

    #[inline(always)]
    fn drop_sample() -> &'static DropSample<[u8; 4]> {
        &maps::DROP_SAMPLE_V4
    }

    #[inline(always)]
    fn drop_sample_slots() -> u32 {
        maps::set_by_agent(&maps::MASQ_DROP_SAMPLE_SLOTS_V4)
    }

    #[inline(always)]
    fn fragments() -> &'static FragmentTable<[u8; 4]> {
        &maps::FRAGMENTS_V4
    }

    #[inline(always)]
    fn decide(addr: [u8; 4]) -> Decision {
        policy::decide_v4(addr)
    }

    #[inline(always)]
    fn is_draining_destination(addr: [u8; 4]) -> bool {
        policy::in_trie(&maps::DRAINING_V4, addr)
    }

    #[inline(always)]
    fn source_trie() -> &'static PolicyTrie<[u8; 4]> {
        &maps::NON_MASQ_SRC_V4
    }

    const SOURCES_DECIDED: u32 = sources_decided::V4;

    #[inline(always)]
    fn rewrite_addr_and_ports(
        ctx: &TcContext,
        ip: &Packet<[u8; 4]>,
        field: AddrField,
        new: [u8; 4],
        l4_csum: Option<L4Checksum>,
        ports: Option<Ports>,
    ) -> Result<bool, i64> {
        csum::rewrite_ipv4_addr(ctx, ip, field, new, l4_csum, ports)
    }
}

impl Family for V6 {
    type Addr = [u8; 16];
    const ICMP: u8 = IPPROTO_ICMPV6;
    const ECHO_REQUEST: u8 = parse::ICMPV6_ECHO_REQUEST;
    const ECHO_REPLY: u8 = parse::ICMPV6_ECHO_REPLY;
    const ICMP_PSEUDO_HEADER: bool = true;
    const LEN_OFF: usize = parse::IPV6_LEN_OFF;
    const LEN_UNCOUNTED: usize = parse::IPV6_HLEN;
    const SADDR_OFF: usize = parse::IPV6_SADDR_OFF;
    const DADDR_OFF: usize = parse::IPV6_DADDR_OFF;
    const IP_CSUM_OFF: Option<usize> = None;
    const OWN_FRAMES: bool = true;
    const EARLY_DROP: extern "C" fn(u64) -> i64 = early_drop::masq_early_drop_v6;
    const DROP_RANK: extern "C" fn(u32, u64) -> i64 = early_drop::masq_drop_rank_v6;
    const DROP_RANKED: extern "C" fn(u32, i64, u64) -> i64 = early_drop::masq_drop_ranked_v6;
    const RESERVE_PORT: extern "C" fn() -> i64 = nat::masq_reserve_port_v6;
    const FIND_SLOT: extern "C" fn(*const NatKey<[u8; 16]>) -> i64 = flow_table::masq_find_slot_v6;
    const INSERT_SLOT: extern "C" fn(*const NatKey<[u8; 16]>, *const NatEntry<[u8; 16]>) -> i32 =
        flow_table::masq_insert_slot_v6;
    const REMOVE_SLOT: extern "C" fn(*const NatKey<[u8; 16]>) -> i32 =
        flow_table::masq_remove_slot_v6;
    const SWEEP_AHEAD: extern "C" fn(u32) -> i64 = sweep::masq_sweep_ahead_v6;
    const DROP_VACANCY: u32 = masq_ebpf::drop_vacancy::V6;
    const SWEEP_REPORT: u32 = masq_ebpf::sweep_report::V6;

    #[inline(always)]
    fn port_request() -> &'static PortRequests<[u8; 16]> {
        &maps::PORT_REQUEST_V6
    }

    #[inline(always)]
    fn parse_at(ctx: &TcContext, offset: usize) -> Option<Packet<[u8; 16]>> {
        parse::ipv6_at(ctx, offset)
    }

    /// Destination unreachable, packet too big, time exceeded and parameter problem.
    #[inline(always)]
    fn is_icmp_error(icmp_type: u8) -> bool {
        (parse::ICMPV6_DEST_UNREACH..=parse::ICMPV6_PARAMETER_PROBLEM).contains(&icmp_type)
    }

    /// All zeros when the agent masquerades no IPv6 here.
    #[inline(always)]
    fn node_addr(iface: &Interface) -> Option<[u8; 16]> {
        (iface.ipv6 != [0; 16]).then_some(iface.ipv6)
    }

    #[inline(always)]
    fn chosen_addr(iface: &Interface) -> Option<[u8; 16]> {
        (iface.masquerade_ipv6 != [0; 16]).then_some(iface.masquerade_ipv6)
    }

    #[inline(always)]
    fn is_chosen_addr(iface: &Interface, addr: &[u8; 16]) -> bool {
        iface.masquerade_ipv6 == *addr
    }

    /// Not multicast (ff00::/8), nor link-local (fe80::/10), which no pod is reached at from
    /// outside.
    #[inline(always)]
    fn is_unicast(addr: &[u8; 16]) -> bool {
        addr[0] != 0xff && !(addr[0] == 0xfe && addr[1] & 0xc0 == 0x80)
    }

    #[inline(always)]
    fn nat() -> &'static NatTable<[u8; 16]> {
        &maps::NAT_V6
    }

    #[inline(always)]
    fn slots() -> &'static SlotArray<[u8; 16]> {
        &maps::NAT_SLOTS_V6
    }

    #[inline(always)]
    fn slot_words() -> &'static SlotWords {
        &maps::NAT_SLOT_WORDS_V6
    }

    #[inline(always)]
    fn slot_buckets() -> u32 {
        maps::set_by_agent(&maps::MASQ_SLOT_BUCKETS_V6)
    }

    #[inline(always)]
    fn slot_seed() -> u64 {
        maps::set_by_agent(&maps::MASQ_SLOT_SEED_V6)
    }

    #[inline(always)]
    fn in_slot_table() -> bool {
        maps::in_slot_table()
    }

    #[inline(always)]
    fn drop_sample() -> &'static DropSample<[u8; 16]> {
        &maps::DROP_SAMPLE_V6
    }

    #[inline(always)]
    fn drop_sample_slots() -> u32 {
        maps::set_by_agent(&maps::MASQ_DROP_SAMPLE_SLOTS_V6)
    }

    #[inline(always)]
    fn fragments() -> &'static FragmentTable<[u8; 16]> {
        &maps::FRAGMENTS_V6
    }

    #[inline(always)]
    fn decide(addr: [u8; 16]) -> Decision {
        policy::decide_v6(&addr)
    }

    #[inline(always)]
    fn is_draining_destination(addr: [u8; 16]) -> bool {
        policy::in_trie(&maps::DRAINING_V6, addr)
    }

    #[inline(always)]
    fn source_trie() -> &'static PolicyTrie<[u8; 16]> {
        &maps::NON_MASQ_SRC_V6
    }

    const SOURCES_DECIDED: u32 = sources_decided::V6;

    /// The ports are stored apart: the address's store carries its change into `skb->csum`
    /// (`rewrite_ipv6_addr`), where a port's change must not go.
    #[inline(always)]
    fn rewrite_addr_and_ports(
        ctx: &TcContext,
        ip: &Packet<[u8; 16]>,
        field: AddrField,
        new: [u8; 16],
        l4_csum: Option<L4Checksum>,
        _ports: Option<Ports>,
    ) -> Result<bool, i64> {
        csum::rewrite_ipv6_addr(ctx, ip, field, new, l4_csum).map(|()| false)
    }
}

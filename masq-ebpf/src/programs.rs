//! The tc entry points and the three decisions they make, named after Cilium's `nat.h`:
//! `snat_needs_masquerade` (egress: rewrite this packet?), `snat_nat` (egress: rewrite the
//! source) and `snat_rev_nat` (ingress: restore the destination of replies, and of ICMP errors
//! about translated flows). Each is written once for both families, over `Family`. One job,
//! the decisions of the data path, as `nat.h` is Cilium's: parsing, NAT state, ports and
//! checksums live in their own modules.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use masq_ebpf::{
    Address, Counter, Decision, EARLY_DROP_ROUNDS, FlowOwner, IPPROTO_TCP, IPPROTO_UDP, Interface,
    NatEntry, NatKey, direction, nat_kind,
    tcp_flags::{ACK, SYN},
    tcp_seen,
};

use crate::{
    csum::{self, AddrField, L4Checksum, Ports},
    early_drop::{self, SampleSlot},
    family::{Family, V4, V6},
    flow_table, frag, hint, maps,
    nat::{self, AllocError, IdentityError, Made, Segment, WithoutRoom},
    parse::{self, ETH_HLEN, L4, Packet},
    policy, ports, verifier,
};

/// What tc is to do with a packet: `TC_ACT_OK` (it goes on) or `TC_ACT_SHOT`.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
struct TcAction(i32);

impl TcAction {
    const PASS: TcAction = TcAction(TC_ACT_OK);
    const DROP: TcAction = TcAction(TC_ACT_SHOT);
}

/// A step's answer, in one `i32` as a register carries it back from a call of its own: what tc
/// is to do with the packet (`done`), or one of the step's own answers, each negative and so
/// apart from the `TC_ACT_*` a step gives (`TcAction`: `PASS` or `DROP`; `-1` is also
/// `TC_ACT_UNSPEC`, which no step gives), which the caller goes on with. An enum with data would come
/// back through the stack, which the verifier's 512 bytes cannot spare.
macro_rules! step_outcome {
    (
        $(#[$doc:meta])*
        $name:ident { $($answer:ident = $value:literal),+ $(,)? }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq)]
        #[repr(transparent)]
        struct $name(i32);

        impl $name {
            $(const $answer: $name = $name($value);)+

            #[inline(always)]
            fn done(action: TcAction) -> $name {
                $name(action.0)
            }

            /// What tc is to do, for an answer that is not one of the step's own.
            #[inline(always)]
            fn action(self) -> TcAction {
                TcAction(self.0)
            }
        }
    };
}

#[classifier]
pub fn masq_egress(ctx: TcContext) -> i32 {
    let action = match parse::ethertype(&ctx) {
        Some(parse::ETH_P_IP) => egress_of::<V4>(&ctx),
        Some(parse::ETH_P_IPV6) => egress_of::<V6>(&ctx),
        _ => Verdict::Keep(Counter::NotInspected).count(),
    };
    action.0
}

/// Egress, one family. ICMP other than echo requests is seen to apart from the flows, so that
/// the frame of `egress` is not added to the chain of calls that translates an ICMP error:
/// together they would pass the verifier's 512 bytes of stack.
#[inline(always)]
fn egress_of<F: Family>(ctx: &TcContext) -> TcAction {
    match egress::<F>(ctx) {
        Egress::ICMP_NOT_ECHO_REQUEST => egress_icmp::<F>(ctx),
        egress => egress.action(),
    }
}

step_outcome! {
    /// What `egress` says: what tc is to do with the packet, or that it is ICMP other than an
    /// echo request, which `egress_icmp` sees to.
    Egress { ICMP_NOT_ECHO_REQUEST = -2 }
}

#[classifier]
pub fn masq_ingress(ctx: TcContext) -> i32 {
    let action = match parse::ethertype(&ctx) {
        Some(parse::ETH_P_IP) => ingress::<V4>(&ctx),
        Some(parse::ETH_P_IPV6) => ingress::<V6>(&ctx),
        _ => Verdict::Keep(Counter::NotInspected).count(),
    };
    action.0
}

// Each family's path is a function of its own, so that the stack along one family's calls
// is not added to the other's.
#[inline(never)]
fn egress<F: Family>(ctx: &TcContext) -> Egress {
    let Some(ip) = F::parse_at(ctx, ETH_HLEN) else {
        hint::cold_path();
        return Egress::done(Verdict::Keep(Counter::NotInspected).count());
    };
    if hint::unlikely(ip.is_later_fragment()) {
        return Egress::done(snat_nat_fragment::<F>(ctx, &ip).count());
    }
    if hint::unlikely(!ip.walked_whole) {
        return Egress::done(snat_unwalked::<F>(ctx, &ip).count());
    }
    let l4 = match snat_translatable::<F>(ctx, &ip) {
        Ok(l4) => l4,
        Err(verdict) => {
            hint::cold_path();
            return Egress::done(verdict.count());
        }
    };
    if hint::unlikely(l4.proto == F::ICMP && l4.icmp_type != F::ECHO_REQUEST) {
        return Egress::ICMP_NOT_ECHO_REQUEST;
    }
    if let Some(decision) = left_alone_without_entry::<F>(ip.daddr) {
        return Egress::done(snat_left_alone::<F>(ctx, &ip, decision).count());
    }
    if from_node_socket_without_entry::<F>(ctx, &ip, &l4) {
        return Egress::done(Verdict::Keep(Counter::NotMasqNodeSource).count());
    }
    let key = packet_key(&ip, &l4, direction::EGRESS);
    // A flow that has an entry keeps it, whatever the policy says now, as conntrack does for
    // upstream's chain: policy changes affect new flows only. A pod's SYN that the policy
    // masquerades goes to the new flow's steps without the lookup, which would read a cold
    // bucket to find nothing: they find an entry the flow has where they make its halves.
    let found = if opens_masqueraded_pod_flow::<F>(ctx, &ip, &l4) {
        None
    } else {
        flow_table::find::<F>(&key)
    };
    match found {
        Some(entry) => {
            nat::refresh::<F>(&key, entry, &Segment::read::<F>(ctx, &ip, &l4), false);
            // SAFETY: map value pointer from a successful lookup.
            Egress::done(snat_nat::<F>(ctx, &ip, &l4, unsafe { &*entry }))
        }
        None => {
            hint::cold_path();
            // The device, looked up once for both steps of a new flow that need it: each
            // lookup is a call of the hash table's helper (a first packet 5 % cheaper than
            // with a lookup in each, docs/bench/profiles.md).
            let Some(iface) = Device::<F>::of(ctx).map(|device| device.iface) else {
                return Egress::done(Verdict::Keep(Counter::NotInspected).count());
            };
            // Deciding, allocating and translating are steps of their own, called from here
            // one after the other: nested, their frames would pass the verifier's 512 bytes
            // of stack, which kernels before 6.9 count in steps of 32 bytes a frame.
            let mut segment = Segment::default();
            let source = match snat_new_flow::<F>(ctx, &ip, &l4, iface, &mut segment) {
                NewFlow::POD_SOURCE => Source::Pod,
                NewFlow::NODE_SOURCE => Source::Node,
                done => return Egress::done(done.action()),
            };
            if let Err(verdict) = snat_keeps_its_address::<F>(&ip, &key, source, &segment) {
                return Egress::done(verdict.count());
            }
            if !snat_request_port::<F>(iface, &key, &segment) {
                return Egress::done(Verdict::Keep(Counter::NotInspected).count());
            }
            // The port search is called from here, between the steps, as each round's below
            // (`nat::search_port`).
            let mut made = snat_masquerade_new::<F>(&key, &segment, nat::search_port::<F>());
            if made == Masquerading::MASQUERADED {
                early_drop::remember::<F>(SampleSlot::RANDOM, &key);
            } else if made == Masquerading::TABLE_FULL {
                // A full table drops one flow conntrack would drop early, and is asked once
                // more; steps called one after the other, as above.
                for _ in 0..EARLY_DROP_ROUNDS {
                    let room = early_drop::early_drop::<F>();
                    // No flow dropped (none to drop in the slots looked at, or another CPU
                    // took the one chosen): the next round looks at other slots of the drop
                    // sample, or at the slot table's same buckets again.
                    if !room.dropped() {
                        continue;
                    }
                    made = snat_masquerade_again::<F>(&key, &segment, nat::search_port::<F>());
                    if made == Masquerading::MASQUERADED {
                        early_drop::remember::<F>(SampleSlot::freed(room), &key);
                    }
                    if made != Masquerading::TABLE_FULL {
                        break;
                    }
                }
            }
            Egress::done(match made {
                Masquerading::MASQUERADED | Masquerading::KNOWN_FLOW => {
                    match nat::searched::<F>() {
                        // SAFETY: this CPU's request, as `snat_claim_port` left it.
                        Some(entry) => snat_nat::<F>(ctx, &ip, &l4, unsafe { &*entry }),
                        None => Verdict::Keep(Counter::NotInspected).count(),
                    }
                }
                Masquerading::TABLE_FULL => Verdict::Drop(Counter::DropNatTableFull).count(),
                done => done.action(),
            })
        }
    }
}

step_outcome! {
    /// What `snat_new_flow` says: what tc is to do with the packet, or that the policy
    /// masquerades its flow, and whose flow it is: a pod's, or the node's own (whose flows are
    /// masqueraded only when their port clashes).
    NewFlow { POD_SOURCE = -3, NODE_SOURCE = -4 }
}

step_outcome! {
    /// What `snat_masquerade_new` and `snat_masquerade_again` say: what tc is to do with the
    /// packet, or that the flow's entry is made, or that the table had no room for it, or
    /// that the table held the flow already (`nat::Made::Found`).
    Masquerading { MASQUERADED = -5, TABLE_FULL = -6, KNOWN_FLOW = -7 }
}

/// Whether the packet is a pod's SYN (without ACK) toward a destination the policy
/// masquerades: a connection's first segment, whose flow the table mostly does not hold. The
/// questions `snat_new_flow` asks after it, so that it says `POD_SOURCE`. The policy may
/// change between the two: a flow the table holds, whose SYN came in that moment (sent again,
/// or its tuple used again), then sends that one SYN as the new policy says, untranslated; the
/// next finds the flow.
#[inline(always)]
fn opens_masqueraded_pod_flow<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, l4: &L4) -> bool {
    l4.proto == IPPROTO_TCP
        && parse::tcp_flags(ctx, ip.l4_off).is_some_and(|flags| flags & (SYN | ACK) == SYN)
        && Device::<F>::of(ctx).is_some_and(|device| Source::of(ip, &device) == Source::Pod)
        && !F::leaves_alone(ip.saddr, ip.daddr)
}

/// Whose flow a packet of no known flow starts: a pod's, or the node's own (its source is one
/// of the node's addresses on the device: a node socket's, or netfilter's NAT before the
/// programs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Pod,
    Node,
}

impl Source {
    #[inline(always)]
    fn of<F: Family>(ip: &Packet<F::Addr>, device: &Device<F>) -> Source {
        if device.holds(&ip.saddr) {
            Source::Node
        } else {
            Source::Pod
        }
    }
}

step! {
/// Egress, a packet of no known flow, crossing the device of `iface`. Says:
/// - `POD_SOURCE` or `NODE_SOURCE`: the first of a flow the policy masquerades, with
///   `segment` read;
/// - or what tc is to do: with a packet to leave alone.
fn snat_new_flow<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    l4: &L4,
    iface: &'static Interface,
    segment: &mut Segment,
) -> NewFlow {
    let Some(device) = Device::<F>::on(opaque(iface)) else {
        return NewFlow::done(Verdict::Keep(Counter::NotInspected).count());
    };
    let source = Source::of(ip, &device);
    match snat_needs_masquerade::<F>(ctx, ip, l4, source, segment) {
        Ok(()) if source == Source::Node => NewFlow::NODE_SOURCE,
        Ok(()) => NewFlow::POD_SOURCE,
        Err(verdict) => NewFlow::done(verdict.count()),
    }
}
}

step! {
/// Egress, the first packet of a flow to masquerade, leaving by the device of `iface`: what
/// its port search is asked for (`nat::request_port`), on the device's address, or, for a flow
/// of the node's own (one whose port a masqueraded flow held already), on its own. False where
/// the device or the search's request is missing.
fn snat_request_port<F: Family>(
    iface: &'static Interface,
    key: &NatKey<F::Addr>,
    segment: &Segment,
) -> bool {
    let Some(device) = Device::<F>::on(opaque(iface)) else {
        return false;
    };
    // A node flow's clash moves its port, never its address.
    let to = if device.holds(&key.saddr) {
        key.saddr
    } else {
        device.masquerade_addr()
    };
    nat::request_port::<F>(key, to, segment)
}
}

step! {
/// Egress, the first packet of a flow to masquerade, once its port search (`search`) ran: both
/// halves of its entry. Says:
/// - `MASQUERADED`: its egress half is `nat::searched`;
/// - `KNOWN_FLOW`: the table held the flow already, and its egress half is `nat::searched`;
/// - `TABLE_FULL`: no room for the flow (`early_drop` may make some);
/// - or what tc is to do: drop the packet when every port is taken.
fn snat_masquerade_new<F: Family>(
    key: &NatKey<F::Addr>,
    segment: &Segment,
    search: nat::Search,
) -> Masquerading {
    let mut entry = NatEntry::default();
    let made = snat_claim_port::<F>(key, segment, search, &mut entry);
    if matches!(made, Ok(Made::Found)) {
        return Masquerading::KNOWN_FLOW;
    }
    // Asked again rather than kept across the call: a value known on each path that lives
    // through it would have the verifier walk the allocation once per value.
    if !moved_off_a_clash(key, &entry) {
        count_masqueraded::<F>(key);
    }
    masquerading::<F>(key, &entry, made)
}
}

/// `nat::claim_port` on a copy in `entry` of the egress half the search was asked for
/// (`nat::searched`), and the half it leaves written back there, where the program's path
/// reads it to translate the packet. Without the search's request, no port.
#[inline(always)]
fn snat_claim_port<F: Family>(
    key: &NatKey<F::Addr>,
    segment: &Segment,
    search: nat::Search,
    entry: &mut NatEntry<F::Addr>,
) -> Result<Made, AllocError> {
    let Some(searched) = nat::searched::<F>() else {
        return Err(AllocError::PortsExhausted);
    };
    // SAFETY: this CPU's request (`nat::searched`).
    *entry = unsafe { *searched };
    let made = nat::claim_port::<F>(key, segment, search, entry);
    // SAFETY: as above.
    unsafe { *searched = *entry };
    made
}

/// Whether the flow `entry` translates is the node's own, given another port because a
/// masqueraded flow held its own: a translation that keeps the source address.
#[inline(always)]
fn moved_off_a_clash<A: Address>(key: &NatKey<A>, entry: &NatEntry<A>) -> bool {
    FlowOwner::of(key, entry) == FlowOwner::NodeTranslated
}

/// What an allocation (`made`) says for the packet of a new flow, whose egress half is in
/// `entry`; a node's flow moved off a clash is counted.
#[inline(always)]
fn masquerading<F: Family>(
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
    made: Result<Made, AllocError>,
) -> Masquerading {
    match made {
        Ok(Made::New) => {
            if moved_off_a_clash(key, entry) {
                maps::count(Counter::NodePortClash);
            }
            Masquerading::MASQUERADED
        }
        Ok(Made::Found) => Masquerading::KNOWN_FLOW,
        Err(AllocError::PortsExhausted) => {
            Masquerading::done(Verdict::Drop(Counter::DropPortsExhausted).count())
        }
        Err(AllocError::TableFull) => Masquerading::TABLE_FULL,
    }
}

step! {
/// Counts a pod's new flow to masquerade (`egress_key`) for the entries that decided it, of
/// the source trie where the family has source entries, and of the destination trie. Asked
/// again, the verdict cache answering, rather than carried from `snat_new_flow` across the
/// allocation: a step of its own, whose frame is not stacked on the port search's.
fn count_masqueraded<F: Family>(egress_key: &NatKey<F::Addr>) {
    if let Some(by_source) = F::decide_source(egress_key.saddr) {
        policy::count(by_source);
    }
    policy::count(F::decide(egress_key.daddr));
}
}

step! {
/// Egress, the first packet of a flow to masquerade, once `early_drop` made room in a full
/// table and its port was searched for again (`search`): both halves of its entry. Says what
/// `snat_masquerade_new` says; `TABLE_FULL` when another CPU's flow took the room first.
fn snat_masquerade_again<F: Family>(
    key: &NatKey<F::Addr>,
    segment: &Segment,
    search: nat::Search,
) -> Masquerading {
    let mut entry = NatEntry::default();
    let made = snat_claim_port::<F>(key, segment, search, &mut entry);
    masquerading::<F>(key, &entry, made)
}
}

// Each family's path is a function of its own, so that the stack along one family's calls
// is not added to the other's.
#[inline(never)]
fn ingress<F: Family>(ctx: &TcContext) -> TcAction {
    let Some(ip) = F::parse_at(ctx, ETH_HLEN) else {
        return Verdict::Keep(Counter::NotInspected).count();
    };
    snat_rev_nat::<F>(ctx, &ip)
}

/// The NAT key of a packet's own tuple, as seen in direction `dir`.
#[inline(always)]
fn packet_key<A: Copy>(ip: &Packet<A>, l4: &L4, dir: u8) -> NatKey<A> {
    nat::key(ip.saddr, ip.daddr, l4.proto, l4.sport, l4.dport, dir)
}

/// The device a packet crosses, as the agent configured it for the family. The packets of
/// established flows leaving skip its lookup; coming in, each reads its element of
/// `interfaces_by_ifindex` (a line every packet of the device reads) to know whether it comes
/// to the node's own address, where the replies of masqueraded flows come.
struct Device<F: Family> {
    iface: &'static Interface,
    /// The device's own address.
    addr: F::Addr,
}

impl<F: Family> Device<F> {
    /// `None` until the agent has configured both the device and NAT's settings (which the
    /// port search reads).
    #[inline(always)]
    fn of(ctx: &TcContext) -> Option<Device<F>> {
        let iface = Self::entry(ctx)?;
        maps::settings().filter(|s| s.total_ports != 0)?;
        Self::on(iface)
    }

    /// The device of `iface`, an entry `of` found: its address read again.
    #[inline(always)]
    fn on(iface: &'static Interface) -> Option<Device<F>> {
        Some(Device {
            iface,
            addr: F::node_addr(iface)?,
        })
    }

    /// The `interfaces` entry of the device the packet crosses: from `interfaces_by_ifindex`
    /// where its element is in use, a few instructions; else from the hash table, whose lookup
    /// was half of what a packet left alone costs (docs/bench/profiles.md, "The device's
    /// lookup on the paths of packets left alone").
    #[inline(always)]
    fn entry(ctx: &TcContext) -> Option<&'static Interface> {
        // SAFETY: the context pointer is valid for the program's run.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        if let Some(indexed) = maps::INTERFACES_BY_IFINDEX.get(ifindex)
            && hint::likely(indexed.in_use != 0)
        {
            // No write changes the element while a run that saw it in use may read it
            // (`masq_ebpf::IndexedInterface`).
            return Some(&indexed.iface);
        }
        // SAFETY: the map value lives as long as the program runs, and is only read.
        Some(unsafe { &*maps::INTERFACES.get_ptr(ifindex)? })
    }

    /// Whether `addr` is the node's own on this device: the device's address, or the chosen
    /// masquerade address while the node holds it. Flows from either are the node's (a
    /// socket's, or netfilter's NAT before the programs), whose ports pods' flows must not
    /// take; connections to either are the node's services', not a pod's.
    #[inline(always)]
    fn holds(&self, addr: &F::Addr) -> bool {
        *addr == self.addr || F::is_chosen_addr(self.iface, addr)
    }

    /// The address a pod's masqueraded flow leaving by this device takes: the one chosen
    /// (`masqueradeAddress`) while the agent says the node holds it, or else the device's own.
    #[inline(always)]
    fn masquerade_addr(&self) -> F::Addr {
        F::chosen_addr(self.iface).unwrap_or(self.addr)
    }
}

/// `iface` as the caller passed it, so that LLVM does not hand a step the entry's addresses in
/// its stead (argument promotion): sixteen-byte values take more registers than a call has.
#[inline(always)]
fn opaque(iface: &'static Interface) -> &'static Interface {
    core::hint::black_box(iface)
}

/// What happens to a packet, and the counter that records why.
enum Verdict {
    Keep(Counter),
    Drop(Counter),
}

impl Verdict {
    /// A translated packet goes on, counted as `done`; one whose rewrite failed half-way is
    /// dropped rather than sent half-translated.
    #[inline(always)]
    fn after_rewrite(rewritten: Result<(), i64>, done: Counter) -> TcAction {
        Verdict::after(rewritten, done).count()
    }

    #[inline(always)]
    fn after(rewritten: Result<(), i64>, done: Counter) -> Verdict {
        match hint::rarely_failing(rewritten) {
            Ok(()) => Verdict::Keep(done),
            Err(_) => Verdict::Drop(Counter::DropRewriteFailed),
        }
    }

    #[inline(always)]
    fn count(self) -> TcAction {
        match self {
            Verdict::Keep(counter) => {
                maps::count(counter);
                TcAction::PASS
            }
            Verdict::Drop(counter) => {
                maps::count(counter);
                TcAction::DROP
            }
        }
    }
}

/// Egress, a packet of no known flow whose ports the programs cannot see: a later fragment
/// whose first never came, or IPv6 whose L4 header lies past the extension headers walked.
/// It passes where nothing would have translated it (the node's own, a protocol the chain
/// handles, `left_to_chain`, or a non-masquerade destination); otherwise it is dropped and
/// counted as `dropped`, rather than sent with the pod's address.
#[inline(always)]
fn snat_untranslatable<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    left_to_chain: Option<Verdict>,
    dropped: Counter,
) -> Verdict {
    match Device::<F>::of(ctx) {
        None => return Verdict::Keep(Counter::NotInspected),
        Some(device) if device.holds(&ip.saddr) => {
            return Verdict::Keep(Counter::NotMasqNodeSource);
        }
        Some(_) => {}
    }
    if let Some(verdict) = left_to_chain {
        return verdict;
    }
    if F::leaves_alone(ip.saddr, ip.daddr) {
        return Verdict::Keep(Counter::NotMasqNonMasqDestination);
    }
    Verdict::Drop(dropped)
}

/// Egress packets of protocols left to the chain.
#[inline(always)]
fn snat_other_protocol<F: Family>(ip: &Packet<F::Addr>) -> Option<Verdict> {
    (ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP && ip.proto != F::ICMP)
        .then_some(Verdict::Keep(Counter::NotMasqOtherProtocol))
}

/// Egress: could this packet be translated at all (an ICMP error, about a flow)? Its L4 header
/// if so. The node's own packets
/// are told apart later, once no flow is found for them: established flows skip the lookup of
/// the node's address.
#[inline(always)]
fn snat_translatable<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>) -> Result<L4, Verdict> {
    if let Some(verdict) = snat_other_protocol::<F>(ip) {
        return Err(verdict);
    }
    let Some(l4) = parse::l4(ctx, ip.l4_off, ip.proto) else {
        return Err(Verdict::Keep(Counter::NotInspected));
    };
    Ok(l4)
}

step! {
/// Egress, an IPv6 packet whose extension headers run on past what is walked: its L4 header is
/// out of sight, but ip6tables' protocol match walks any chain, so the reduced chain would let
/// it out with the pod's address. Dropped, unless it would have kept its address anyway.
fn snat_unwalked<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>) -> Verdict {
    snat_untranslatable::<F>(ctx, ip, None, Counter::DropExtensionHeaders)
}
}

/// Egress, for a flow without an entry: does the policy say it leaves with the node's address?
/// Only when both its destination and (for a family with source entries) its source say so.
/// Reads the packet's `segment` once the answer may depend on it: the packets of flows to
/// non-masquerade destinations, which have no entry, come this way each, and need none of it.
/// A pod's packet is counted for the policy entries that decided it: a masqueraded flow once,
/// as its entry carries the rest; a flow that keeps its address at every packet, as nothing
/// here holds it. The node's own packets are not the policy's to decide. What the flow's state
/// says (`snat_keeps_its_address`) comes after, a step of its own.
#[inline(always)]
fn snat_needs_masquerade<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    l4: &L4,
    source: Source,
    segment: &mut Segment,
) -> Result<(), Verdict> {
    let decision = F::decide(ip.daddr);
    if decision.keeps_address {
        return Err(keeps_its_address(decision, source));
    }
    // A pod's flow to masquerade is counted once it is known to be new
    // (`snat_masquerade_new`): a SYN comes here without a lookup.
    if source == Source::Pod
        && let Some(by_source) = F::decide_source(ip.saddr)
        && by_source.keeps_address
    {
        policy::count(by_source);
        return Err(Verdict::Keep(Counter::NotMasqNonMasqSource));
    }
    *segment = Segment::read::<F>(ctx, ip, l4);
    Ok(())
}

/// Egress, a packet the policy leaves alone, toward `decision`'s destination: counted for the
/// entry that decided it when it is a pod's.
#[inline(always)]
fn keeps_its_address(decision: Decision, source: Source) -> Verdict {
    if source == Source::Node {
        return Verdict::Keep(Counter::NotMasqNodeSource);
    }
    policy::count(decision);
    Verdict::Keep(Counter::NotMasqNonMasqDestination)
}

/// The policy's decision for a flow's remote end, `remote`, where the policy leaves it alone
/// and the agent says no flow outlived a policy change: then no flow with that remote end has
/// an entry, and its packets, either way, need no lookup in the NAT table. The agent's check
/// reads every egress half's destination, and a reply half's source is its egress half's
/// destination (`NatKey::reverse`). A reply half alone, for the moment its flow is made or
/// removed, and the flows the agent records as left alone just before a change that will
/// masquerade their destination, would let their packets pass untouched anyway. The flag is
/// read again after the decision: the agent clears it before it changes a trie, so a decision
/// that saw the change sees the flag cleared too.
#[inline(always)]
fn left_alone_without_entry<F: Family>(remote: F::Addr) -> Option<Decision> {
    if !maps::strays_cleared() {
        return None;
    }
    let decision = F::decide(remote);
    (decision.keeps_address && maps::strays_cleared()).then_some(decision)
}

/// Egress, a packet toward a destination the policy leaves alone, with no flow entry to look
/// for (`left_alone_without_entry`).
#[inline(always)]
fn snat_left_alone<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    decision: Decision,
) -> Verdict {
    match Device::<F>::of(ctx) {
        Some(device) => keeps_its_address(decision, Source::of(ip, &device)),
        None => Verdict::Keep(Counter::NotInspected),
    }
}

step! {
/// Egress, a flow that keeps its source address, and is remembered so:
/// - the node's own (`Source::Node`): a node socket's, or one netfilter masqueraded already
///   (kube-proxy's MASQUERADE). Its tuple on the node's address is held, so that no
///   masqueraded flow is given it; if one holds it already, the node's flow is translated to
///   another port instead, as conntrack resolves a clash, and no reply ever reaches the wrong
///   flow. Only where a masqueraded flow could be given its port (`node_port_reservable`):
///   replies to connections from outside to the node's services take no entry;
/// - a TCP connection past its SYN, to a destination that just left the non-masquerade CIDRs:
///   it started unmasqueraded, and translating it now would break it. With the table full it
///   goes on without an entry, as the draining trie leaves it while it may live, rather than
///   be translated in the room an early drop would make for it (conntrack never moves a live
///   flow).
fn snat_keeps_its_address<F: Family>(
    ip: &Packet<F::Addr>,
    key: &NatKey<F::Addr>,
    source: Source,
    segment: &Segment,
) -> Result<(), Verdict> {
    if source == Source::Node {
        if !node_port_reservable(key, segment) {
            return Err(Verdict::Keep(Counter::NotMasqNodeSource));
        }
        return match nat::track_identity::<F>(
            key,
            nat_kind::NODE,
            direction::EGRESS,
            segment,
            WithoutRoom::GiveBack,
        ) {
            Err(IdentityError::Taken) => Ok(()),
            // Remembered; or, with the table full, it goes as it would without the programs.
            _ => Err(Verdict::Keep(Counter::NotMasqNodeSource)),
        };
    }
    if segment.is_tcp()
        && segment.seen & tcp_seen::OPENING == 0
        && F::is_draining_destination(ip.daddr)
        && matches!(
            nat::track_identity::<F>(
                key,
                nat_kind::PASSTHROUGH,
                direction::EGRESS,
                segment,
                WithoutRoom::GiveBack
            ),
            Ok(()) | Err(IdentityError::NotRecorded | IdentityError::TableFull)
        )
    {
        return Err(Verdict::Keep(Counter::NotMasqInbound));
    }
    Ok(())
}
}

/// Egress: a packet one of the node's sockets sent from one of its addresses, on a port no
/// entry holds (`node_end_without_entry`: a client's ephemeral port, a service's). None does,
/// so it leaves as a packet of no known flow would, without the NAT table's lookup: a cold
/// one, for every packet of the node's own connections. Asked first whether a socket sent it
/// (`skb->sk`), which costs one load: a pod's packets reach the node through their veth
/// without one, and go to the table's lookup at once.
#[inline(always)]
fn from_node_socket_without_entry<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    l4: &L4,
) -> bool {
    // SAFETY: the context pointer is valid for the program's run; the socket pointer is only
    // compared with null, never followed.
    let sent_by_a_socket = unsafe { !(*ctx.skb.skb).__bindgen_anon_2.sk.is_null() };
    sent_by_a_socket && node_end_without_entry::<F>(ctx, &ip.saddr, l4.proto, l4.sport)
}

/// Ingress: a TCP or UDP packet to one of the node's addresses, on a port no entry holds
/// (`node_end_without_entry`: a reply to one of the node's clients, a connection to one of its
/// services). It passes as a packet of no known flow would, without the NAT table's lookup.
#[inline(always)]
fn to_node_without_entry<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, l4: &L4) -> bool {
    node_end_without_entry::<F>(ctx, &ip.daddr, l4.proto, l4.dport)
}

/// Whether `addr`:`port` (network byte order) of `proto`, a flow's end on the node's side, is
/// one of the node's addresses on a port no entry holds (`ports::without_entry`). The port is
/// asked first, the cheaper question.
#[inline(always)]
fn node_end_without_entry<F: Family>(
    ctx: &TcContext,
    addr: &F::Addr,
    proto: u8,
    port: u16,
) -> bool {
    ports::without_entry(proto, port)
        && Device::<F>::of(ctx).is_some_and(|device| device.holds(addr))
}

/// Whether a node flow leaving as `key` needs its tuple held: NAT could give its port to a
/// masqueraded flow. Not a port outside the spans (the node's ephemeral range, below 1024), nor
/// one the node holds for its sockets or NodePorts, which NAT skips; nor a TCP reset, which
/// ends its flow.
#[inline(always)]
fn node_port_reservable<A>(key: &NatKey<A>, segment: &Segment) -> bool {
    maps::settings().is_some_and(|settings| ports::in_spans(settings, key.sport))
        && !ports::held_by_node(key.proto, key.sport)
        && segment.seen & tcp_seen::RESET == 0
}

step! {
/// Egress, a fragment after the first: it carries no ports, so it takes the source its first
/// fragment took. One without a known first fragment is dropped rather than sent with the pod's
/// address, unless nothing would have translated it anyway.
fn snat_nat_fragment<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>) -> Verdict {
    if let Some(addr) = frag::recall::<F>(ip, direction::EGRESS) {
        if addr == ip.saddr {
            return Verdict::Keep(Counter::NotMasqInbound);
        }
        let rewritten = F::rewrite_addr(ctx, ip, AddrField::Source, addr, None);
        return Verdict::after(rewritten, Counter::Masqueraded);
    }
    let left_to_chain = snat_other_protocol::<F>(ip);
    snat_untranslatable::<F>(ctx, ip, left_to_chain, Counter::DropFragment)
}
}

step! {
/// Egress: rewrite the source as the flow's entry says.
fn snat_nat<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    l4: &L4,
    entry: &NatEntry<F::Addr>,
) -> TcAction {
    if entry.kind != nat_kind::SNAT {
        frag::remember::<F>(ip, direction::EGRESS, &ip.saddr);
        let why = if entry.kind == nat_kind::NODE {
            Counter::NotMasqNodeSource
        } else {
            Counter::NotMasqInbound
        };
        return Verdict::Keep(why).count();
    }
    frag::remember::<F>(ip, direction::EGRESS, &entry.addr);
    let field = if l4.proto == F::ICMP {
        parse::ICMP_ID_OFF
    } else {
        0
    };
    let rewritten = rewrite::<F>(ctx, ip, AddrField::Source, field, l4, l4.sport, entry);
    Verdict::after_rewrite(rewritten, Counter::Masqueraded)
}
}

/// Whether `proto`'s checksum covers the pseudo-header, and so the addresses.
#[inline(always)]
fn has_pseudo_header<F: Family>(proto: u8) -> bool {
    proto != F::ICMP || F::ICMP_PSEUDO_HEADER
}

/// Rewrites one address (source or destination) and the matching L4 word (port or echo id) to
/// the entry's, with every checksum that covers them.
#[inline(always)]
fn rewrite<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    addr: AddrField,
    l4_field: usize,
    l4: &L4,
    old_word: u16,
    entry: &NatEntry<F::Addr>,
) -> Result<(), i64> {
    let csum_off = ip.l4_off + parse::l4_csum_off(l4.proto);
    let word_changes = old_word != entry.port;
    if word_changes {
        csum::replace_l4_word(ctx, csum_off, l4.proto, old_word, entry.port)?;
    }
    let mut word_stored = false;
    if addr.of(ip) != entry.addr {
        let pseudo = has_pseudo_header::<F>(l4.proto).then_some(L4Checksum {
            off: csum_off,
            proto: l4.proto,
        });
        // A port changed or not, the ports as they are to be.
        let ports = (l4.proto != F::ICMP).then_some(match addr {
            AddrField::Source => Ports {
                sport: entry.port,
                dport: l4.dport,
            },
            AddrField::Destination => Ports {
                sport: l4.sport,
                dport: entry.port,
            },
        });
        word_stored = F::rewrite_addr_and_ports(ctx, ip, addr, entry.addr, pseudo, ports)?;
    }
    if word_changes && !word_stored {
        ctx.store(ip.l4_off + l4_field, &entry.port, 0)?;
    }
    Ok(())
}

/// Ingress: restore the pod's address in replies to masqueraded flows, and remember connections
/// opened from outside toward pods.
#[inline(always)]
fn snat_rev_nat<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>) -> TcAction {
    if ip.is_later_fragment() {
        return snat_rev_nat_fragment::<F>(ctx, ip);
    }
    let Some(l4) = parse::l4(ctx, ip.l4_off, ip.proto) else {
        return TcAction::PASS;
    };
    if l4.proto == IPPROTO_TCP
        || l4.proto == IPPROTO_UDP
        || (l4.proto == F::ICMP && l4.icmp_type == F::ECHO_REPLY)
    {
        if l4.proto != F::ICMP && to_node_without_entry::<F>(ctx, ip, &l4) {
            return TcAction::PASS;
        }
        // From a remote end the policy leaves alone: a pod's flow toward the cluster coming
        // back, or another node's pod connecting to one here, most of what crosses a node's
        // uplink inbound. No flow to look up, and none to remember (`snat_track_inbound`
        // remembers connections from remote ends that masquerade). Asked only of packets to
        // an address not the node's: the replies of masqueraded flows come to the node's, and
        // the decision would cost each some 10 ns before its lookup (docs/architecture.md).
        if !Device::<F>::entry(ctx)
            .and_then(Device::<F>::on)
            .is_some_and(|device| device.holds(&ip.daddr))
            && left_alone_without_entry::<F>(ip.saddr).is_some()
        {
            return TcAction::PASS;
        }
        match snat_rev_nat_flow::<F>(ctx, ip, &l4) {
            // Called from here rather than from the flow's own step, so that the two frames
            // never stack.
            OfFlow::UNKNOWN_FLOW => {
                // The chosen masquerade address is the node's, as the device's is (which
                // `snat_track_inbound` asks about): no pod's. Asked here, where the frame has
                // room for it.
                if Device::<F>::entry(ctx).is_some_and(|iface| F::is_chosen_addr(iface, &ip.daddr))
                {
                    return TcAction::PASS;
                }
                // A full table makes room for a connection toward a pod as for a pod's own new
                // flow, as conntrack does for any; called from here, where the frame of
                // `snat_track_inbound` is not on the stack. A round for each half the slot
                // table may find no room for, in buckets of its own (one in the hash table,
                // where a drop makes room for both), not `egress`'s `EARLY_DROP_ROUNDS`: every
                // call of the step is one more walk of it for the verifier, and a connection
                // that loses the room to another CPU's flow is retransmitted. The ingress half
                // is kept until the last round, so that the second drop makes room for the
                // egress half alone (`WithoutRoom`). A round follows a drop that dropped
                // nothing too (another CPU's may have made room), and the last gives the kept
                // half back.
                let mut tracked =
                    snat_track_inbound::<F>(ctx, ip, &l4, WithoutRoom::KeepIngressHalf);
                if tracked == Inbound::TableFull {
                    early_drop::early_drop::<F>();
                    let without_room = if F::in_slot_table() {
                        WithoutRoom::KeepIngressHalf
                    } else {
                        WithoutRoom::GiveBack
                    };
                    tracked = snat_track_inbound::<F>(ctx, ip, &l4, without_room);
                }
                if F::in_slot_table() && tracked == Inbound::TableFull {
                    early_drop::early_drop::<F>();
                    tracked = snat_track_inbound::<F>(ctx, ip, &l4, WithoutRoom::GiveBack);
                }
                if tracked == Inbound::Room {
                    return TcAction::PASS;
                }
                // Untracked, its replies would leave masqueraded: conntrack too drops what it
                // has no room for.
                Verdict::Drop(Counter::DropNatTableFull).count()
            }
            done => done.action(),
        }
    } else if l4.proto == F::ICMP && F::is_icmp_error(l4.icmp_type) {
        match snat_icmp_error::<F>(ctx, ip, direction::INGRESS) {
            OfFlow::UNKNOWN_FLOW => TcAction::PASS,
            done => done.action(),
        }
    } else {
        TcAction::PASS
    }
}

step_outcome! {
    /// What a step that looks a packet's flow up says: what tc is to do with the packet, or
    /// that no masqueraded flow is known for it.
    OfFlow { UNKNOWN_FLOW = -1 }
}

/// The NAT key a packet coming in would find its flow under: its own tuple, or for an echo
/// reply, its identifier in the pod-side port.
#[inline(always)]
fn ingress_key<A: Copy>(ip: &Packet<A>, l4: &L4, icmp: u8) -> NatKey<A> {
    if l4.proto == icmp {
        let (sport, dport) = echo_ports(direction::INGRESS, l4.sport);
        nat::key(ip.saddr, ip.daddr, icmp, sport, dport, direction::INGRESS)
    } else {
        packet_key(ip, l4, direction::INGRESS)
    }
}

/// The ports of an echo flow's key in direction `dir`: the identifier stands in the pod-side
/// port, the other is 0.
#[inline(always)]
fn echo_ports(dir: u8, id: u16) -> (u16, u16) {
    if dir == direction::EGRESS {
        (id, 0)
    } else {
        (0, id)
    }
}

step! {
/// Ingress, a TCP or UDP packet or an echo reply: restore the destination its flow left from.
/// Says `UNKNOWN_FLOW` if it has none, or what tc is to do: pass the packet, translated or
/// (for a flow that keeps its address) as it is, or drop one whose rewrite failed.
fn snat_rev_nat_flow<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, l4: &L4) -> OfFlow {
    let key = ingress_key(ip, l4, F::ICMP);
    let field = if l4.proto == F::ICMP {
        parse::ICMP_ID_OFF
    } else {
        2
    };
    let Some(entry) = flow_table::find::<F>(&key) else {
        return OfFlow::UNKNOWN_FLOW;
    };
    nat::refresh::<F>(&key, entry, &Segment::read::<F>(ctx, ip, l4), true);
    // SAFETY: map value pointer from a successful lookup.
    let entry = unsafe { &*entry };
    if entry.kind != nat_kind::SNAT {
        return OfFlow::done(TcAction::PASS);
    }
    frag::remember::<F>(ip, direction::INGRESS, &entry.addr);
    let rewritten = rewrite::<F>(
        ctx,
        ip,
        AddrField::Destination,
        field,
        l4,
        key.dport,
        entry,
    );
    OfFlow::done(Verdict::after_rewrite(rewritten, Counter::ReverseTranslated))
}
}

/// What `snat_track_inbound` says of the table: it had room for the connection (or the packet
/// opens none), or it had none (`early_drop` may make some), for both halves or, the ingress
/// half kept as `WithoutRoom` asked, for the egress half.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inbound {
    Room,
    TableFull,
}

step! {
/// Ingress, a packet of no known flow: a connection opened from outside toward a pod's own
/// address is remembered, so that the pod's replies keep that address. A TCP connection opens
/// with a SYN: stray segments (to an address the node no longer has, say) open nothing. Where
/// the egress half finds no room, the ingress half is kept or given back as `without_room`
/// says.
fn snat_track_inbound<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    l4: &L4,
    without_room: WithoutRoom,
) -> Inbound {
    let key = &ingress_key(ip, l4, F::ICMP);
    let segment = Segment::read::<F>(ctx, ip, l4);
    if l4.proto != F::ICMP
        && (l4.proto != IPPROTO_TCP || segment.opens())
        && F::is_unicast(&ip.daddr)
        && Device::<F>::of(ctx).is_some_and(|device| ip.daddr != device.addr)
        && !F::is_non_masq_destination(ip.saddr)
    {
        match nat::track_identity::<F>(
            &nat::identity_reverse(key),
            nat_kind::PASSTHROUGH,
            direction::INGRESS,
            &segment,
            without_room,
        ) {
            Ok(()) => maps::count(Counter::InboundTracked),
            Err(IdentityError::TableFull) => return Inbound::TableFull,
            Err(_) => {}
        }
    }
    Inbound::Room
}
}

step! {
/// Ingress, a fragment after the first: it takes the destination its first fragment took. One
/// without a known first fragment passes as it is: it may well be the node's own.
fn snat_rev_nat_fragment<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>) -> TcAction {
    match frag::recall::<F>(ip, direction::INGRESS) {
        Some(addr) if addr != ip.daddr => {
            let rewritten = F::rewrite_addr(ctx, ip, AddrField::Destination, addr, None);
            Verdict::after_rewrite(rewritten, Counter::ReverseTranslated)
        }
        _ => TcAction::PASS,
    }
}
}

/// What a rewrite reports when the field it must read back is not in the packet.
const EFAULT: i64 = -14;

/// Egress ICMP other than an echo request, parsed afresh (see `egress_of`): an error about a
/// masqueraded flow is translated; anything else (an echo reply, an error about a flow left
/// alone) keeps its address.
#[inline(never)]
fn egress_icmp<F: Family>(ctx: &TcContext) -> TcAction {
    if let Some(ip) = F::parse_at(ctx, ETH_HLEN)
        && let Some(icmp_type) = parse::read::<u8>(ctx, ip.l4_off)
        && F::is_icmp_error(icmp_type)
    {
        let error = snat_icmp_error::<F>(ctx, &ip, direction::EGRESS);
        if error != OfFlow::UNKNOWN_FLOW {
            return error.action();
        }
    }
    Verdict::Keep(Counter::NotMasqIcmpOther).count()
}

step! {
/// An ICMP error (destination unreachable, fragmentation needed or packet too big, time
/// exceeded, parameter problem) crossing the node in direction `dir`, about a packet of a
/// masqueraded flow that went the other way. On ingress it quotes a packet as it left, from the
/// node's address and NAT port: the outer destination and the quoted source go back to the
/// pod's. On egress (the pod's own error, or the node's about a reply it restored) it quotes a
/// reply as the pod got it: the quoted destination becomes the node's address and NAT port,
/// and the outer source the node's address, as conntrack translates a RELATED error. Every
/// checksum that covers them follows. Says `UNKNOWN_FLOW` for an error about no masqueraded
/// flow, or what tc is to do: pass the translated error, or drop one whose rewrite failed.
fn snat_icmp_error<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, dir: u8) -> OfFlow {
    let Some(inner) = F::parse_at(ctx, ip.l4_off + 8) else {
        return OfFlow::UNKNOWN_FLOW;
    };
    // An error goes back to where the packet it quotes came from.
    if inner.saddr != ip.daddr || inner.is_later_fragment() {
        return OfFlow::UNKNOWN_FLOW;
    }
    // Errors need only quote 8 bytes of L4 header: enough for ports, or an echo identifier.
    let Some(l4) = parse::quoted_l4(ctx, inner.l4_off, inner.proto) else {
        return OfFlow::UNKNOWN_FLOW;
    };
    // The quoted packet went against `dir`: an answer to it goes with `dir`, and finds the
    // flow's half of that direction. An echo went out as a request and came back as a reply.
    let quoted_echo = if dir == direction::INGRESS {
        F::ECHO_REQUEST
    } else {
        F::ECHO_REPLY
    };
    let (sport, dport) = if l4.proto == IPPROTO_TCP || l4.proto == IPPROTO_UDP {
        (l4.dport, l4.sport)
    } else if l4.proto == F::ICMP && l4.icmp_type == quoted_echo {
        echo_ports(dir, l4.sport)
    } else {
        return OfFlow::UNKNOWN_FLOW;
    };
    let key = nat::key(inner.daddr, inner.saddr, l4.proto, sport, dport, dir);
    let Some(entry) = flow_table::find::<F>(&key) else {
        return OfFlow::UNKNOWN_FLOW;
    };
    // SAFETY: map value pointer from a successful lookup.
    let entry = unsafe { &*entry };
    if entry.kind != nat_kind::SNAT {
        return OfFlow::UNKNOWN_FLOW;
    }
    let (translated, done) = if dir == direction::INGRESS {
        (AddrField::Source, Counter::IcmpErrorTranslated)
    } else {
        (AddrField::Destination, Counter::IcmpErrorMasqueraded)
    };
    let rewritten = rewrite_icmp_error::<F>(ctx, ip, &inner, entry, translated);
    OfFlow::done(Verdict::after_rewrite(verifier::result(rewritten), done))
}
}

step! {
/// Rewrites the error quoting `inner` as `entry` says: the quoted packet's `translated` address
/// and its port or echo identifier there; returns the helpers' error code (see
/// `verifier::code`). A step of its own: the checksum arithmetic over sixteen-byte addresses
/// needs a frame of its own.
fn rewrite_icmp_error<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    inner: &Packet<F::Addr>,
    entry: &NatEntry<F::Addr>,
    translated: AddrField,
) -> i64 {
    verifier::code(rewrite_icmp_error_fields::<F>(ctx, ip, inner, entry, translated))
}
}

#[inline(always)]
fn rewrite_icmp_error_fields<F: Family>(
    ctx: &TcContext,
    ip: &Packet<F::Addr>,
    inner: &Packet<F::Addr>,
    entry: &NatEntry<F::Addr>,
    translated: AddrField,
) -> Result<(), i64> {
    let proto = inner.proto;
    // The quoted packet's word on the translated side: its port there, or the echo identifier.
    let word_off = inner.l4_off
        + match (proto == F::ICMP, translated) {
            (true, _) => parse::ICMP_ID_OFF,
            (false, AddrField::Source) => 0,
            (false, AddrField::Destination) => 2,
        };
    let old_word: u16 = parse::read(ctx, word_off).ok_or(EFAULT)?;
    let old_addr = translated.of(inner);
    let icmp_csum_off = ip.l4_off + parse::ICMP_CSUM_OFF;
    let mut icmp_csum: u16 = parse::read(ctx, icmp_csum_off).ok_or(EFAULT)?;

    // The quoted IP header: the address, and IPv4's own checksum over it. The error's
    // checksum covers both.
    icmp_csum = csum::replace_addr(icmp_csum, old_addr, entry.addr);
    ctx.store(inner.ip_off + F::addr_off(translated), &entry.addr, 0)?;
    if let Some(check_off) = F::IP_CSUM_OFF {
        let inner_check = csum::replace_addr(inner.ip_check, old_addr, entry.addr);
        icmp_csum = csum::replace_word(icmp_csum, inner.ip_check, inner_check);
        ctx.store(inner.ip_off + check_off, &inner_check, 0)?;
    }

    // The quoted port or echo identifier.
    icmp_csum = csum::replace_word(icmp_csum, old_word, entry.port);
    ctx.store(word_off, &entry.port, 0)?;

    // The quoted L4 checksum, when the error quotes enough of the packet to hold it.
    let quoted_csum_off = inner.l4_off + parse::l4_csum_off(proto);
    if let Some(old) = parse::read::<u16>(ctx, quoted_csum_off)
        && !(proto == IPPROTO_UDP && old == 0)
    {
        let mut new = csum::replace_word(old, old_word, entry.port);
        if has_pseudo_header::<F>(proto) {
            new = csum::replace_addr(new, old_addr, entry.addr);
        }
        if proto == IPPROTO_UDP && new == 0 {
            new = 0xffff;
        }
        icmp_csum = csum::replace_word(icmp_csum, old, new);
        ctx.store(quoted_csum_off, &new, 0)?;
    }
    ctx.store(icmp_csum_off, &icmp_csum, 0)?;

    // The outer address at the node's end (the destination on ingress, the source on egress),
    // and ICMPv6's pseudo-header, which holds it.
    let outer = translated.other();
    if outer.of(ip) == entry.addr {
        return Ok(());
    }
    let pseudo = F::ICMP_PSEUDO_HEADER.then_some(L4Checksum {
        off: icmp_csum_off,
        proto: F::ICMP,
    });
    F::rewrite_addr(ctx, ip, outer, entry.addr, pseudo)
}

//! NAT state: the two halves of every translated flow (kept where `flow_table` keeps them),
//! how they are created, found and kept fresh. The reply-direction half is created first, and
//! only where the table holds none of its key (`flow_table::insert_new`), so two CPUs can never
//! hand the same port to two flows.

use aya_ebpf::programs::TcContext;
use masq_ebpf::{
    Address, Counter, FlowState, IPPROTO_TCP, LAST_SEEN_REFRESH_NS, NatEntry, NatKey, direction,
    nat_kind, packets_seen, slot_table,
    tcp_flags::{ACK, FIN, RST, SYN},
    tcp_seen,
};

use crate::{
    clock::now_ns,
    early_drop::{self, SampleSlot},
    family::Family,
    flow_table, maps,
    parse::{self, L4, Packet},
    ports, verifier,
};

/// Why a new flow could not be given a translation.
pub enum AllocError {
    PortsExhausted,
    TableFull,
}

/// Where a flow's translation came from.
pub enum Made {
    /// Both halves were made for it now.
    New,
    /// The table held the flow already (a SYN sent again, or a tuple used again, that came
    /// without a lookup; or another CPU's first packet of the same flow), and its half was
    /// refreshed by the packet, as a lookup's would be.
    Found,
}

/// A NAT table key. For ICMP echo, the identifier stands in the pod-side port and the other
/// port is 0.
#[inline(always)]
pub fn key<A>(saddr: A, daddr: A, proto: u8, sport: u16, dport: u16, dir: u8) -> NatKey<A> {
    NatKey {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        direction: dir,
        _pad: [0; 2],
    }
}

/// What one packet tells about its half of a flow: for TCP, how far the connection got and
/// where its sender stands in the sequence space; nothing for UDP and ICMP.
#[derive(Clone, Copy, Default)]
#[repr(C, align(8))]
pub struct Segment {
    /// `tcp_seen` bits; 0 for other protocols.
    pub seen: u8,
    pub seq: u32,
    /// The sequence number after the segment: its payload, and one each for SYN and FIN.
    pub end: u32,
    /// The acknowledgment number, where `seen` has `tcp_seen::ACKED`.
    pub ack: u32,
}

impl Segment {
    /// What the packet `ip`, with L4 header `l4`, tells.
    #[inline(always)]
    pub fn read<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, l4: &L4) -> Segment {
        let mut segment = Segment::default();
        if l4.proto == IPPROTO_TCP {
            read_tcp::<F>(ctx, ip, &mut segment);
        }
        segment
    }

    /// Every TCP segment is past the handshake's first step or in it; other packets are not
    /// TCP.
    #[inline(always)]
    pub fn is_tcp(&self) -> bool {
        self.seen != 0
    }

    /// A TCP segment that opens a connection: SYN without ACK.
    #[inline(always)]
    pub fn opens(&self) -> bool {
        self.seen & (tcp_seen::OPENING | tcp_seen::ACKED) == tcp_seen::OPENING
    }
}

step! {
/// Fills `segment` from the TCP header behind `ip`. A function of its own, filling what its
/// caller holds: the header's fields and the datagram's length take no room in the frames of
/// the steps that need a segment.
fn read_tcp<F: Family>(ctx: &TcContext, ip: &Packet<F::Addr>, segment: &mut Segment) {
    let Some(tcp) = parse::tcp_header(ctx, ip.l4_off) else {
        return;
    };
    let flags = tcp.flags;
    let mut seen = tcp_seen::SEQ
        | if flags & SYN != 0 {
            tcp_seen::OPENING
        } else {
            tcp_seen::PAST_OPENING
        };
    if flags & FIN != 0 {
        seen |= tcp_seen::CLOSING;
    }
    if flags & RST != 0 {
        seen |= tcp_seen::RESET;
    }
    if flags & ACK != 0 {
        seen |= tcp_seen::ACKED;
    }
    let end = parse::datagram_end(ctx, ip.ip_off, F::LEN_OFF, F::LEN_UNCOUNTED);
    let payload = end.saturating_sub(ip.l4_off + usize::from(tcp.len)) as u32;
    let flags_len = u32::from(flags & SYN != 0) + u32::from(flags & FIN != 0);
    *segment = Segment {
        seen,
        seq: tcp.seq,
        end: tcp.seq.wrapping_add(payload).wrapping_add(flags_len),
        ack: tcp.ack,
    };
}
}

/// Whether sequence number `a` lies after `b`, modulo 2^32.
#[inline(always)]
fn after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// A half as `segment` leaves it when it is the half's first packet.
#[inline(always)]
fn half<A: Address>(addr: A, port: u16, kind: u8, segment: &Segment, now: u64) -> NatEntry<A> {
    NatEntry {
        last_seen_ns: now,
        addr,
        port,
        kind,
        tcp_seen: segment.seen,
        tcp_next_seq: segment.end,
        tcp_max_ack: segment.ack,
        _pad: Default::default(),
    }
}

/// The other half of a new flow, which no packet has crossed yet.
#[inline(always)]
fn unseen<A: Address>(addr: A, port: u16, kind: u8, now: u64) -> NatEntry<A> {
    half(addr, port, kind, &Segment::default(), now)
}

/// Records that the flow is alive, and what a TCP segment tells of it; `key` is the half
/// `entry` holds, and `from_outside` says whether the segment came in from outside the node
/// (ingress), whose FINs must be within reach (`fin_acceptable`). A constant at each call:
/// the egress program's callers leave the check out, and the verifier never walks it there.
#[inline(always)]
pub fn refresh<F: Family>(
    key: &NatKey<F::Addr>,
    entry: *mut NatEntry<F::Addr>,
    segment: &Segment,
    from_outside: bool,
) {
    // SAFETY: `entry` points into a map value; concurrent updates race benignly (both write a
    // recent time).
    unsafe {
        let now = now_ns();
        if now.wrapping_sub((*entry).last_seen_ns) > LAST_SEEN_REFRESH_NS {
            (*entry).last_seen_ns = now;
        }
    }
    if segment.seen != 0 {
        track_tcp::<F>(key, entry, segment, from_outside);
    } else {
        count_packet::<F>(entry);
    }
}

/// Counts a packet of a protocol other than TCP on its half, up to two (`packets_seen`): the
/// half is written twice in the flow's life at most.
#[inline(always)]
fn count_packet<F: Family>(entry: *mut NatEntry<F::Addr>) {
    // SAFETY: `entry` points into a map value; two CPUs counting at once set the same bits.
    unsafe {
        let before = (*entry).tcp_seen;
        if before & packets_seen::AGAIN == 0 {
            (*entry).tcp_seen = before
                | if before & packets_seen::ONCE == 0 {
                    packets_seen::ONCE
                } else {
                    packets_seen::AGAIN
                };
        }
    }
}

/// Moves a TCP half on by one segment: its flags, the furthest sequence number it sent and the
/// highest acknowledgment. Only the half's own direction writes it, so the cache line stays
/// with the CPU that handles that direction.
#[inline(always)]
fn track_tcp<F: Family>(
    key: &NatKey<F::Addr>,
    entry: *mut NatEntry<F::Addr>,
    segment: &Segment,
    from_outside: bool,
) {
    if segment.opens() && reopened::<F>(key, entry, segment) {
        maps::count(Counter::TcpReopened);
        return;
    }
    let mut seen = segment.seen;
    let acked = seen & tcp_seen::ACKED != 0;
    if seen & tcp_seen::RESET != 0
        && !rst_acceptable::<F>(key, entry, segment.seq, segment.ack, acked)
    {
        maps::count(Counter::TcpRstNotAcceptable);
        seen &= !tcp_seen::RESET;
    }
    if from_outside
        && seen & tcp_seen::CLOSING != 0
        // SAFETY: as in `refresh`.
        && unsafe { (*entry).tcp_seen } & tcp_seen::CLOSING == 0
        && !fin_acceptable::<F>(key, entry, segment.seq)
    {
        maps::count(Counter::TcpFinNotAcceptable);
        seen &= !tcp_seen::CLOSING;
    }
    // SAFETY: as in `refresh`. Two CPUs moving one half at once may leave either's numbers,
    // both recent: at worst an RST is judged against the other of two recent segments.
    unsafe {
        let before = (*entry).tcp_seen;
        if before & seen != seen {
            (*entry).tcp_seen = before | seen;
        }
        if before & tcp_seen::SEQ == 0 || after(segment.end, (*entry).tcp_next_seq) {
            (*entry).tcp_next_seq = segment.end;
        }
        if seen & tcp_seen::ACKED != 0
            && (before & tcp_seen::ACKED == 0 || after(segment.ack, (*entry).tcp_max_ack))
        {
            (*entry).tcp_max_ack = segment.ack;
        }
    }
}

step! {
/// Whether `segment`, a SYN on `entry`'s half (keyed `key`), found its connection over (reset,
/// or closed both ways: `FlowState::done`) and so started the flow anew, as conntrack reopens a
/// connection on a tuple it still holds (a client that reuses its port): the flow keeps its
/// port, and loses the old connection's state. With that state the new connection would expire
/// ten seconds after its last packet and be the first a full table drops, however long it
/// lives. A function of its own, as `rst_acceptable` is: a SYN on a known flow is rare.
///
/// Only the end that opened the flow reopens it, as only conntrack's original direction does
/// from a reset: from outside, a connection made to a pod's own address (`PASSTHROUGH`). A
/// masqueraded or node flow was opened by the node's side; conntrack takes the other end's SYN
/// there as invalid, or as a connection of its own, never as this flow's.
fn reopened<F: Family>(key: &NatKey<F::Addr>, entry: *mut NatEntry<F::Addr>, segment: &Segment) -> bool {
    // A SYN that carries a FIN or an RST too opens nothing (conntrack: invalid flags).
    if segment.seen & (tcp_seen::CLOSING | tcp_seen::RESET) != 0
        // SAFETY: `entry` points into a map value; a byte copied out.
        || (key.direction == direction::INGRESS && unsafe { (*entry).kind } != nat_kind::PASSTHROUGH)
    {
        return false;
    }
    let Some(other) = receiving_half::<F>(key, entry) else {
        return false;
    };
    // SAFETY: both are map value pointers from successful lookups, read where they lie (copies
    // of two IPv6 halves would take the deepest chain of frames past 448 bytes of stack).
    let (this, that) = unsafe { (&*entry, &*other) };
    // A reply half whose egress half names another (a stray the sweep has not met yet) is not
    // that flow's: its state is not this SYN's to start anew.
    if key.direction == direction::INGRESS && (that.addr != key.daddr || that.port != key.dport) {
        return false;
    }
    let (egress, ingress) = if key.direction == direction::EGRESS {
        (this, that)
    } else {
        (that, this)
    };
    if !FlowState::of(key, egress, ingress).done() {
        return false;
    }
    // SAFETY: as above. Another CPU's packet of the old connection, crossing at once, may put
    // back a flag this clears (`track_tcp` writes what it read before, with its own): the new
    // connection then keeps the old one's closing state, as it did before this reopening.
    unsafe {
        (*entry).tcp_seen = segment.seen;
        (*entry).tcp_next_seq = segment.end;
        (*entry).tcp_max_ack = segment.ack;
        (*other).tcp_seen = 0;
        (*other).last_seen_ns = (*entry).last_seen_ns;
    }
    true
}
}

step! {
/// Whether the end that receives an RST would accept it, as conntrack judges (RFC 5961 §3):
/// its sequence number is the highest acknowledgment the receiver sent, or directly follows
/// the sender's own last segment (an RST right behind data); before the receiver acknowledged
/// anything, it must acknowledge (`acked`, with `ack`) the receiver's SYN. A function of its
/// own, taking the segment's numbers in registers: the other half's key takes room that other
/// packets never need.
///
/// From outside, the sender's last segment counts only within `SEQ_REACH` of what the
/// receiver acknowledged. Any segment moves its half's next sequence number on, and a blind
/// sender picks its own: a segment at a number of its choosing and an RST right behind it
/// reset a pod's connection, two packets for each guess of the node's port, where conntrack
/// takes only a segment within the receiver's window as the one an RST may follow. The node's
/// side (pods, and the node's own sockets) sends what it sends: its own segments count.
fn rst_acceptable<F: Family>(
    key: &NatKey<F::Addr>,
    entry: *mut NatEntry<F::Addr>,
    seq: u32,
    ack: u32,
    acked: bool,
) -> bool {
    // SAFETY: `entry` points into a map value; its fields are copied out.
    let (sent, next_seq) = unsafe { ((*entry).tcp_seen, (*entry).tcp_next_seq) };
    let behind_own_segment = sent & tcp_seen::SEQ != 0 && seq == next_seq;
    // The node's side's RST right behind its own segment counts whatever the receiver did
    // (below): the usual end of a pod's connection needs no lookup of the other half.
    if behind_own_segment && key.direction == direction::EGRESS {
        return true;
    }
    let Some(other) = receiving_half::<F>(key, entry) else {
        // Half a flow cannot translate replies anyway.
        return true;
    };
    // SAFETY: map value pointer from a successful lookup; its fields are copied out.
    let (seen, max_ack, other_next) =
        unsafe { ((*other).tcp_seen, (*other).tcp_max_ack, (*other).tcp_next_seq) };
    if seen & tcp_seen::ACKED != 0 {
        // Here a segment of the sender's own is one from outside (the node's side returned
        // above): it counts only within reach.
        seq == max_ack || (behind_own_segment && within_reach(next_seq, max_ack))
    } else {
        behind_own_segment || (seen & tcp_seen::SEQ != 0 && acked && ack == other_next)
    }
}
}

step! {
/// Whether a FIN from outside may close its half: its sequence number lies within `SEQ_REACH`
/// of what the pod (or the node's socket) acknowledged, after the receiver acknowledged
/// anything at all. Any FIN used to: one blind FIN, at any number, gave a pod's established
/// connection a closing state's timeout (two minutes idle, against five days) and let a full
/// table drop it, where conntrack takes a FIN outside the window as invalid and the state
/// stays. A function of its own, as `rst_acceptable` is.
fn fin_acceptable<F: Family>(key: &NatKey<F::Addr>, entry: *mut NatEntry<F::Addr>, seq: u32) -> bool {
    let Some(receiver) = receiving_half::<F>(key, entry) else {
        // Half a flow cannot translate replies anyway.
        return true;
    };
    // SAFETY: map value pointer from a successful lookup; its fields are copied out.
    let (seen, max_ack) = unsafe { ((*receiver).tcp_seen, (*receiver).tcp_max_ack) };
    seen & tcp_seen::ACKED != 0 && within_reach(seq, max_ack)
}
}

/// The flow's other half, keyed as the segments that `entry`'s half (keyed `key`) sends are
/// received, if the table holds it: what an RST or a FIN is judged against, and what a SYN
/// that reopens the flow starts anew.
#[inline(always)]
fn receiving_half<F: Family>(
    key: &NatKey<F::Addr>,
    entry: *mut NatEntry<F::Addr>,
) -> Option<*mut NatEntry<F::Addr>> {
    // SAFETY: `entry` points into a map value; its fields are copied out.
    flow_table::find::<F>(&key.reverse(unsafe { &*entry }))
}

/// How far from what the receiver acknowledged a segment from outside may lie for an RST right
/// behind it, or its FIN, to count: 16 MiB, more than a receive window holds unacknowledged on
/// all but the longest fattest paths (where such a segment's RST or FIN is passed on and the
/// flow expires by its timeout instead). A blind sender's number lands there once in 128
/// guesses; conntrack's own window is as wide as the flow's receive windows have been.
const SEQ_REACH: u32 = 1 << 24;

/// Whether sequence numbers `a` and `b` lie within `SEQ_REACH` of each other, modulo 2^32.
#[inline(always)]
fn within_reach(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) <= SEQ_REACH || b.wrapping_sub(a) <= SEQ_REACH
}

/// Asks this CPU's port search (`search_port`) for a port for the new egress flow of
/// `egress_key` on `to`, one of the node's addresses: the flow's egress half, without its port,
/// goes in the search's request. A global BPF function takes no pointer before Linux 5.12: the
/// flow goes in and its port comes back through this CPU's `PortRequest`. False without one
/// (which a per-CPU array of one always has).
#[inline(always)]
pub fn request_port<F: Family>(
    egress_key: &NatKey<F::Addr>,
    to: F::Addr,
    segment: &Segment,
) -> bool {
    let Some(request) = F::port_request().get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU map; a tc program runs to its end on one CPU, and
    // none of ours runs inside another there.
    unsafe {
        (*request).egress_key = *egress_key;
        (*request).egress = half(to, 0, nat_kind::SNAT, segment, now_ns());
    }
    true
}

/// What a port search (`search_port`) says, as its global function returns it, in one
/// register: the port it reserved, or why it reserved none.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct Search(i64);

/// Searches' answers other than a port, which is never 0 or negative.
const PORTS_EXHAUSTED: i64 = -1;
/// No port whose reply half had room (the slot table), or no room at all (the hash table).
const TABLE_FULL: i64 = -2;

impl Search {
    /// The port reserved: the flow's reply half holds it.
    #[inline(always)]
    pub fn reserved(self) -> Option<u16> {
        (self.0 > 0).then_some(self.0 as u16)
    }
}

/// Finds the flow of this CPU's request (`request_port`) a free port and reserves it by
/// inserting the flow's reply half. The search runs in the family's global BPF function
/// (`masq_reserve_port_v4` or `_v6`), which the verifier walks once, where it walks a static
/// one again in every state its callers reach it with (the first packets of the protocols and
/// of pods and the node, and a full table's new flows once a drop made room). Its frame, and
/// the insert's below it, leave IPv6 room above them for the program's path alone within the
/// verifier's 512 bytes of stack (on kernels before 6.9, which count each frame in steps of 32
/// bytes): the path calls it, not a step of its own.
#[inline(always)]
pub fn search_port<F: Family>() -> Search {
    Search((F::RESERVE_PORT)())
}

/// The egress half of the new flow that `request_port` asked a port for, and the one its
/// steps keep there after the search (`claim_port` sets its port to the one reserved): where
/// the program's path reads it to translate the packet, and where a search after an early
/// drop starts from, rather than in the path's frame, which IPv6's deepest chain cannot spare.
/// The search hands its port back in a register, and writes nothing of the half: a load over
/// a recent narrower store waits until that store is done, and a store of the port at the
/// search's end would be done only after those of the reply half's insert, to a line of the
/// table that is rarely in the cache (a first packet cost some 60 ns more so, measured).
#[inline(always)]
pub fn searched<F: Family>() -> Option<*mut NatEntry<F::Addr>> {
    // SAFETY: as in `request_port`.
    F::port_request()
        .get_ptr_mut(0)
        .map(|request| unsafe { &raw mut (*request).egress })
}

/// Publishes the egress half of the flow a port search (`search`) was for, its port reserved;
/// where no port could be had, finds the flow's own halves if the table holds them
/// (`Made::Found`). The egress half, as the search was asked for it (`searched`), is left in
/// `egress`, with the port reserved. Once `early_drop`
/// made room in a full table, the search is all of it again: not one port retried, which
/// failed in every round when taken, and each round dropped another flow for nothing (the one
/// the first search found no room for may be the node's, as it is asked only once a port is
/// reserved, or another CPU's flow's by now; the dropped flow's is free only toward that
/// flow's destination).
#[inline(always)]
pub fn claim_port<F: Family>(
    egress_key: &NatKey<F::Addr>,
    segment: &Segment,
    search: Search,
    egress: &mut NatEntry<F::Addr>,
) -> Result<Made, AllocError> {
    if let Some(port) = search.reserved() {
        egress.port = port;
        let ingress_key = egress_key.reverse(egress);
        return publish_egress::<F>(egress_key, &ingress_key, segment, egress);
    }
    // A pod's SYN comes to the search without a lookup, and another CPU may have made the
    // same flow since: where no port could be had, the flow may hold one already.
    if let Some(existing) = flow_table::find::<F>(egress_key) {
        return Ok(adopt::<F>(egress_key, existing, segment, egress));
    }
    if search.0 == PORTS_EXHAUSTED {
        maps::count(Counter::AllocationFailed);
        return Err(AllocError::PortsExhausted);
    }
    Err(AllocError::TableFull)
}

/// `search_port`'s search, in each family's global BPF function.
#[inline(always)]
fn reserve_port_global<F: Family>() -> i64 {
    // As in `request_port`: no port without them.
    let (Some(request), Some(settings)) = (F::port_request().get_ptr_mut(0), maps::settings())
    else {
        return PORTS_EXHAUSTED;
    };
    // SAFETY: as in `request_port`, which filled it.
    let request = unsafe { &mut *request };
    let egress_key = &request.egress_key;
    // The reply half differs from one attempt to the next only in its port. No reply has
    // crossed it yet: established means both ways seen.
    let mut ingress_key = egress_key.reverse(&request.egress);
    let ingress = unseen(
        egress_key.saddr,
        egress_key.sport,
        request.egress.kind,
        request.egress.last_seen_ns,
    );
    // Each span a port may come from is a path of its own for the verifier, and every attempt
    // would multiply them.
    let start = verifier::forget_in(
        &mut request.unknown,
        ports::first_offset(settings, egress_key.sport),
    );
    let retry = port_to_retry::<F>(request, settings, &ingress_key);
    // Whether a port was passed over for want of room in its reply half's buckets, which only
    // the slot table refuses one port for and not another: if that is all the search found,
    // the table is full, not the ports.
    let mut without_room = false;
    // The port to retry, if any, first, and then the search's own.
    for attempt in 0..=ports::MAX_ATTEMPTS {
        let port = match (attempt, retry) {
            (0, Some(port)) => port,
            (0, None) => continue,
            _ => ports::candidate(settings, start, attempt - 1),
        };
        ingress_key.dport = verifier::forget_in(&mut request.unknown, u32::from(port)) as u16;
        // By reference: copies for the helper would take the frame past the verifier's limit.
        let (key, value) = (&ingress_key, &ingress);
        match flow_table::insert_new::<F>(key, value) {
            // A port the node holds for its sockets or NodePorts is given back at once. Asked
            // here, on the path that returns, and not before every insert: there the verifier
            // walks each attempt both ways, and a load takes twice the instructions. For the
            // moment the reservation stands, only a reply from the very remote address and
            // port the pod asked for could meet it, on a port the node listens on: a client's
            // port, which no pod connects to.
            Ok(()) if ports::held_by_node(request.egress_key.proto, ingress_key.dport) => {
                let _ = flow_table::remove::<F>(key);
                continue;
            }
            Ok(()) => return i64::from(ingress_key.dport),
            Err(err) if err.exists() => continue,
            Err(_) if F::in_slot_table() => without_room = true,
            Err(_) => return TABLE_FULL,
        }
    }
    if without_room {
        TABLE_FULL
    } else {
        PORTS_EXHAUSTED
    }
}

/// The port a search of the slot table after an early drop tries first: the room the drop
/// made is in the buckets of one half's key only. That is the port the flow's last search
/// reserved (`request.egress.port`, 0 on a first search), whose reply half had room, where its
/// egress half found none and the drop made some for it; or else that of the reply half this
/// CPU last found no room for (`PortRequest::no_room_for`), where it was one toward this flow's
/// remote end (`ingress_key`, whatever its port), in whose buckets the drop made room. Tried
/// before the search's own candidates, not instead of them: another flow toward the same end
/// may have taken it since, and without `--random-fully` the pod's own port still comes
/// first among them. The hash table has room anywhere or nowhere.
#[inline(always)]
fn port_to_retry<F: Family>(
    request: &maps::PortRequest<F::Addr>,
    settings: &masq_ebpf::Settings,
    ingress_key: &NatKey<F::Addr>,
) -> Option<u16> {
    if !F::in_slot_table() {
        return None;
    }
    let port = if request.egress.port != 0 {
        request.egress.port
    } else {
        let mut reply = *ingress_key;
        reply.dport = request.no_room_for.dport;
        if !slot_table::same_key(&reply, &request.no_room_for) {
            return None;
        }
        reply.dport
    };
    // The agent may have changed the ports NAT hands out since.
    ports::in_spans(settings, port).then_some(port)
}

/// `search_port` for IPv4, a global BPF function.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_reserve_port_v4() -> i64 {
    reserve_port_global::<crate::family::V4>()
}

/// `search_port` for IPv6, a global BPF function.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_reserve_port_v6() -> i64 {
    reserve_port_global::<crate::family::V6>()
}

/// Inserts the egress half once its port is reserved. If the table holds the flow already (see
/// `Made::Found`), its translation stands, refreshed by `segment` and copied into `egress`,
/// and our reservation is released.
#[inline(always)]
fn publish_egress<F: Family>(
    egress_key: &NatKey<F::Addr>,
    ingress_key: &NatKey<F::Addr>,
    segment: &Segment,
    egress: &mut NatEntry<F::Addr>,
) -> Result<Made, AllocError> {
    if flow_table::insert_new::<F>(egress_key, egress).is_ok() {
        return Ok(Made::New);
    }
    // Refused: the flow's half is there, another CPU's; or the slot table's buckets changed
    // under every claim it tried, as they do while another CPU makes the same flow in them,
    // which is no full table.
    if let Some(existing) = flow_table::find::<F>(egress_key) {
        let _ = flow_table::remove::<F>(ingress_key);
        return Ok(adopt::<F>(egress_key, existing, segment, egress));
    }
    // Neither: the flow's half went between the two (swept, or dropped early), or the claims
    // are over. Once more, and then the table is full.
    if flow_table::insert_new::<F>(egress_key, egress).is_ok() {
        return Ok(Made::New);
    }
    let _ = flow_table::remove::<F>(ingress_key);
    Err(AllocError::TableFull)
}

/// The flow's own half, found where a new one was to go: `segment` refreshes it, as after a
/// lookup, and its translation is copied into `egress`.
#[inline(always)]
fn adopt<F: Family>(
    egress_key: &NatKey<F::Addr>,
    existing: *mut NatEntry<F::Addr>,
    segment: &Segment,
    egress: &mut NatEntry<F::Addr>,
) -> Made {
    refresh::<F>(egress_key, existing, segment, false);
    // SAFETY: `existing` is a map value pointer, from its callers' successful lookups.
    *egress = unsafe { *existing };
    Made::Found
}

/// Why a flow could not be remembered as one to leave alone.
pub enum IdentityError {
    /// The other half's key (the flow's tuple as replies carry it) is another flow's: on the
    /// node's address, a masqueraded flow holds the same port.
    Taken,
    /// The table is full (`early_drop` may make room), for both halves or, its ingress half
    /// kept (`WithoutRoom::KeepIngressHalf`), for the egress half.
    TableFull,
    /// Another CPU remembered the same flow first (or, its wait for another CPU's insert
    /// over, nothing says which flow holds the key): the packet goes as it would without the
    /// programs.
    NotRecorded,
}

/// What `track_identity` does with the ingress half it holds when the egress half finds no
/// room.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum WithoutRoom {
    /// Gives it back: no early drop and no call for the same flow follow.
    GiveBack,
    /// Keeps it, so that an early drop in the egress half's buckets makes room for that half
    /// alone, and the next call for the flow makes it there (it takes up a flow whose ingress
    /// half it finds without its egress half). Given back, the room the first drop made for
    /// the ingress half could be taken by the egress half, or the second drop's by the ingress
    /// half, where their buckets meet: the slot table would need a third drop, or refuse the
    /// flow. The half kept is never dropped meanwhile: a flow without its egress half is none
    /// to drop (`early_drop`).
    KeepIngressHalf,
}

/// Remembers a flow that must never be translated (`egress_key` is its tuple as it leaves),
/// of `kind`: a connection opened from outside toward a pod, one that started unmasqueraded
/// before its destination left the non-masquerade CIDRs (`PASSTHROUGH`), or a flow of the
/// node's own address (`NODE`). Both halves are identity entries; `segment`, the packet that
/// opened it, crossed the half of direction `dir`. The reply half goes in first: on the node's
/// address it reserves the tuple against masqueraded flows, as their reply halves do. Where
/// the table holds the flow's ingress half without its egress half (kept through an early drop,
/// `WithoutRoom::KeepIngressHalf`, or another CPU's between its two inserts), the egress half is
/// made to go with it.
#[inline(always)]
pub fn track_identity<F: Family>(
    egress_key: &NatKey<F::Addr>,
    kind: u8,
    dir: u8,
    segment: &Segment,
    without_room: WithoutRoom,
) -> Result<(), IdentityError> {
    let now = now_ns();
    let unseen = Segment::default();
    let (egress_segment, ingress_segment) = if dir == direction::EGRESS {
        (segment, &unseen)
    } else {
        (&unseen, segment)
    };
    // The egress half is made once the ingress half is in: two halves at once in the frame
    // took IPv6's chain of frames past the verifier's 512 bytes.
    let (addr, port) = (egress_key.saddr, egress_key.sport);
    let ingress_key = &identity_reverse(egress_key);
    // A scope of its own, so that the two halves share their place in the frame.
    {
        let ingress = half(
            ingress_key.daddr,
            ingress_key.dport,
            kind,
            ingress_segment,
            now,
        );
        match flow_table::insert_new::<F>(ingress_key, &ingress) {
            Ok(()) => {}
            Err(err) if err.exists() => match holder::<F>(ingress_key, &ingress) {
                Holder::ThisFlow if flow_table::find::<F>(egress_key).is_none() => {}
                Holder::ThisFlow | Holder::Unknown => return Err(IdentityError::NotRecorded),
                Holder::AnotherFlow => return Err(IdentityError::Taken),
            },
            Err(_) => return Err(IdentityError::TableFull),
        }
    }
    let egress = half(addr, port, kind, egress_segment, now);
    // If another CPU gave the egress tuple an entry meanwhile, it keeps it; the ingress half
    // stays only with its own flow's egress half. Room for the ingress half is not room for
    // this one: in the slot table, each half has its own buckets.
    if let Err(err) = flow_table::insert_new::<F>(egress_key, &egress) {
        let exists = err.exists();
        if !exists && without_room == WithoutRoom::KeepIngressHalf {
            return Err(IdentityError::TableFull);
        }
        if !exists || holder::<F>(egress_key, &egress) != Holder::ThisFlow {
            let _ = flow_table::remove::<F>(ingress_key);
        }
        return Err(if exists {
            IdentityError::NotRecorded
        } else {
            IdentityError::TableFull
        });
    }
    early_drop::remember::<F>(SampleSlot::RANDOM, egress_key);
    Ok(())
}

/// Whose is the half the table holds under `key`, where an identity flow's half (`identity`)
/// was to go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// The same flow's, made by another CPU, or by this one earlier.
    ThisFlow,
    /// Another flow's, a masqueraded one's, which translates to a pod.
    AnotherFlow,
    /// None is found, as when a wait for another CPU's insert ran out
    /// (`slot_table::insert_new`): no flow is moved off a tuple that no other flow is known to
    /// hold.
    Unknown,
}

#[inline(always)]
fn holder<F: Family>(key: &NatKey<F::Addr>, identity: &NatEntry<F::Addr>) -> Holder {
    let Some(held) = flow_table::find::<F>(key) else {
        return Holder::Unknown;
    };
    // SAFETY: a map value pointer from a successful lookup; its fields are copied out.
    let held = unsafe { &*held };
    if held.kind == identity.kind && held.addr == identity.addr && held.port == identity.port {
        Holder::ThisFlow
    } else {
        Holder::AnotherFlow
    }
}

/// The key of the other half of an identity flow (one that keeps its own tuple) whose half
/// `key` is: the pod-side tuple of a flow whose first packet came in as `key`, or the reply's
/// tuple of one whose first packet left as `key`.
#[inline(always)]
pub fn identity_reverse<A: Address>(key: &NatKey<A>) -> NatKey<A> {
    let (addr, port) = if key.direction == direction::EGRESS {
        (key.saddr, key.sport)
    } else {
        (key.daddr, key.dport)
    };
    key.reverse(&NatEntry {
        addr,
        port,
        ..NatEntry::default()
    })
}

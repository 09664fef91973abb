//! Header parsing. Headers are read straight from the packet's linear data, bounds-checked;
//! only what lies past it (a header in a paged fragment) is fetched with `bpf_skb_load_bytes`.
//! A short packet yields `None` rather than a verifier failure or a misread.
//!
//! Reads never write: a program that writes packet data directly has every cloned skb
//! unshared at entry, translated or not, so all writes go through the store helpers instead.

use aya_ebpf::{bindings::__sk_buff, helpers::bpf_skb_load_bytes, programs::TcContext};
use masq_ebpf::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP};

use crate::{maps, verifier};

pub use masq_ebpf::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6};
/// The IPv4 header without options.
pub const IPV4_HLEN: usize = 20;
pub const IPV4_LEN_OFF: usize = 2;
pub const IPV4_CSUM_OFF: usize = 10;
pub const IPV4_SADDR_OFF: usize = 12;
pub const IPV4_DADDR_OFF: usize = 16;
const IP_OFFSET: u16 = 0x1fff;
const IP_MORE_FRAGMENTS: u16 = 0x2000;
pub const IPV6_HLEN: usize = 40;
pub const IPV6_LEN_OFF: usize = 4;
pub const IPV6_SADDR_OFF: usize = 8;
pub const IPV6_DADDR_OFF: usize = 24;

pub const TCP_CSUM_OFF: usize = 16;
pub const UDP_CSUM_OFF: usize = 6;
pub const ICMP_CSUM_OFF: usize = 2;
pub const ICMP_ID_OFF: usize = 4;
pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_ECHO_REQUEST: u8 = 8;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PARAMETER_PROBLEM: u8 = 12;
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
pub const ICMPV6_ECHO_REPLY: u8 = 129;
/// Where the TCP header's sequence number starts; the acknowledgment number, the data offset and
/// the flags follow it.
const TCP_SEQ_OFF: usize = 4;

/// IPv6 extension headers that ip6tables' protocol match (`ipv6_find_hdr`) steps over, and so
/// the programs too: what `-p tcp` matches in the chain is what they translate.
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
/// Extension headers walked before giving up on a packet; real traffic carries one or two.
const MAX_EXTENSION_HEADERS: usize = 6;

/// The fixed part of an IPv4 header, as laid out on the wire; options follow it.
#[repr(C)]
#[derive(Clone, Copy)]
struct Ipv4Header {
    version_ihl: u8,
    tos: u8,
    total_len: u16,
    id: u16,
    frag: u16,
    ttl: u8,
    protocol: u8,
    check: u16,
    saddr: [u8; 4],
    daddr: [u8; 4],
}

/// The fixed IPv6 header, as laid out on the wire.
#[repr(C)]
#[derive(Clone, Copy)]
struct Ipv6Header {
    version_class_flow: [u8; 4],
    payload_len: u16,
    next_header: u8,
    hop_limit: u8,
    saddr: [u8; 16],
    daddr: [u8; 16],
}

/// Where a packet stands in its datagram's fragmentation.
#[derive(Clone, Copy)]
pub struct Fragment {
    /// The datagram's identification, in network byte order.
    pub id: u32,
    /// The first fragment carries the L4 header for all of them.
    pub first: bool,
    /// The later ones carry none.
    pub later: bool,
}

/// What the translation needs of a packet's IP layer, whatever its family.
#[derive(Clone, Copy)]
pub struct Packet<A> {
    /// Where the IP header starts.
    pub ip_off: usize,
    pub saddr: A,
    pub daddr: A,
    /// The L4 protocol, past IPv6's extension headers.
    pub proto: u8,
    /// Where the L4 header (in a later fragment: the payload) starts.
    pub l4_off: usize,
    /// IPv4's header checksum, which every address rewrite updates; IPv6 has none.
    pub ip_check: u16,
    pub fragment: Fragment,
    /// False for IPv6 whose extension headers run on past `MAX_EXTENSION_HEADERS`: `proto`
    /// and `l4_off` are then the last header walked, not the L4 one.
    pub walked_whole: bool,
}

impl<A> Packet<A> {
    #[inline(always)]
    pub fn is_later_fragment(&self) -> bool {
        self.fragment.later
    }
}

/// The `T` at `offset` in the packet.
#[inline(always)]
pub fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    read_linear(ctx, offset).or_else(|| {
        let mut value = core::mem::MaybeUninit::<T>::uninit();
        // SAFETY: `load` filled `value` whole when it says so.
        load(ctx, offset, &mut value).then(|| unsafe { value.assume_init() })
    })
}

/// The `T` at `offset`, if it lies within the packet's linear data.
#[inline(always)]
fn read_linear<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let start = ctx.data() + offset;
    // At least two bytes: a one-byte check compiles to `start < data_end`, from which the
    // verifier grants no byte at a variable offset. A byte at the very end takes the helper.
    // SAFETY: the bytes lie within the linear data, checked first.
    (start + size_of::<T>().max(2) <= ctx.data_end()).then(|| unsafe { load_linear(start) })
}

/// The `T` at `start`, within the packet's linear data, loaded a word at a time. LLVM cannot
/// know a packet pointer's alignment, and its BPF backend reads an unaligned value a byte at a
/// time (a 20-byte IPv4 header: twenty loads, twenty stores and the loads back; the copies
/// were 6 % of a known flow's samples in the program, docs/bench/profiles.md). The verifier
/// asks aligned packet loads only of architectures without efficient unaligned access, which
/// x86-64 and arm64 have. LLVM's own switch for that (`allows-misaligned-mem-access`) applies
/// to the stack too, whose misaligned accesses every verifier refuses; the loads here are the
/// packet's only.
///
/// # Safety
/// `size_of::<T>()` bytes from `start` lie within the linear data.
#[inline(always)]
unsafe fn load_linear<T: Copy>(start: usize) -> T {
    let size = size_of::<T>();
    if size == 2 {
        // SAFETY: two bytes at `start` are the packet's (the caller's contract); any bits are a
        // valid two-byte `T` (packet fields are integers and byte arrays).
        return unsafe { core::mem::transmute_copy(&packet_half(start)) };
    }
    if !size.is_multiple_of(4) || size > 4 * MAX_WORDS {
        // SAFETY: as the caller says.
        return unsafe { (start as *const T).read_unaligned() };
    }
    let mut words = [0u32; MAX_WORDS];
    macro_rules! word {
        ($($i:literal)+) => {$(
            if $i * 4 < size {
                // SAFETY: the word lies within `size` bytes from `start`.
                words[$i] = unsafe { packet_word::<{ $i * 4 }>(start) };
            }
        )+};
    }
    word!(0 1 2 3 4 5 6 7 8 9);
    // SAFETY: `words` holds `size` bytes as they lie in the packet, and any bits are a valid
    // `T` (packet fields are integers and byte arrays).
    unsafe { core::mem::transmute_copy(&words) }
}

/// The most words `load_linear` reads: an IPv6 header's 40 bytes.
const MAX_WORDS: usize = 10;

/// A load of `$width` from packet data at `$start + $offset` into a 64-bit register; `pure`
/// and `readonly` let LLVM drop one nothing uses. Unsafe: the bytes must lie within the
/// linear data.
macro_rules! packet_load {
    ($width:literal, $start:expr, $offset:expr) => {{
        let loaded: u64;
        core::arch::asm!(
            concat!("{loaded} = *(", $width, " *)({start} + {offset})"),
            loaded = lateout(reg) loaded,
            start = in(reg) $start,
            offset = const $offset,
            options(pure, readonly, nostack),
        );
        loaded
    }};
}

/// The four bytes at `start + OFFSET` in the packet, as they lie in memory.
///
/// # Safety
/// The bytes lie within the linear data.
#[inline(always)]
unsafe fn packet_word<const OFFSET: usize>(start: usize) -> u32 {
    // SAFETY: as the caller says.
    unsafe { packet_load!("u32", start, OFFSET) as u32 }
}

/// The two bytes at `start` in the packet, as they lie in memory.
///
/// # Safety
/// The bytes lie within the linear data.
#[inline(always)]
unsafe fn packet_half(start: usize) -> u16 {
    // SAFETY: as the caller says.
    unsafe { packet_load!("u16", start, 0) as u16 }
}

/// The rare path of `read`: the helper copies the bytes straight into `out`, in the caller's
/// frame, so that it needs no buffer, nor a function of its own, which kernels before 6.9
/// count as 32 bytes of stack even when it has no frame. It says whether it did. On failure
/// the helper zeroes `out`, and the verifier knows `out` written either way.
#[inline(always)]
fn load<T: Copy>(ctx: &TcContext, offset: usize, out: &mut core::mem::MaybeUninit<T>) -> bool {
    // SAFETY: `out` has room for the `size_of::<T>()` bytes the helper writes.
    let code = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            offset as u32,
            out.as_mut_ptr().cast(),
            size_of::<T>() as u32,
        )
    };
    code == 0
}

/// The furthest an L4 header may start: past six extension headers of the largest size.
const MAX_L4_OFF: usize = ETH_HLEN + IPV6_HLEN + MAX_EXTENSION_HEADERS * 2048;

/// The frame's EtherType.
#[inline(always)]
pub fn ethertype(ctx: &TcContext) -> Option<u16> {
    read::<u16>(ctx, 12).map(u16::from_be)
}

/// Parses an IPv4 header at `offset` (also the one quoted inside ICMP errors). Options are
/// stepped over: the reduced chain's protocol match does not look at them, so a packet the
/// programs left alone for its options would leave with the pod's address.
#[inline(always)]
pub fn ipv4_at(ctx: &TcContext, offset: usize) -> Option<Packet<[u8; 4]>> {
    let header: Ipv4Header = read(ctx, offset)?;
    let header_len = usize::from(header.version_ihl & 0x0f) * 4;
    if header.version_ihl >> 4 != 4
        || header_len < IPV4_HLEN
        || (ctx.len() as usize) < offset + header_len
    {
        return None;
    }
    let frag = u16::from_be(header.frag);
    Some(Packet {
        ip_off: offset,
        saddr: header.saddr,
        daddr: header.daddr,
        proto: header.protocol,
        l4_off: offset + header_len,
        ip_check: header.check,
        fragment: Fragment {
            id: u32::from(header.id),
            first: frag & (IP_MORE_FRAGMENTS | IP_OFFSET) == IP_MORE_FRAGMENTS,
            later: frag & IP_OFFSET != 0,
        },
        walked_whole: true,
    })
}

/// Where the datagram whose IP header is at `ip_off` ends, as its length field at `len_off`
/// says (`uncounted`: the header bytes it leaves out): Ethernet padding of short frames lies
/// beyond. A length of 0 is a segmentation-offload packet longer than the field holds (BIG
/// TCP): it ends with the skb. Only TCP's sequence tracking needs it, so it is read then.
#[inline(always)]
pub fn datagram_end(ctx: &TcContext, ip_off: usize, len_off: usize, uncounted: usize) -> usize {
    let frame_end = ctx.len() as usize;
    match read::<u16>(ctx, ip_off + len_off).map(u16::from_be) {
        Some(0) | None => frame_end,
        Some(len) => frame_end.min(ip_off + uncounted + usize::from(len)),
    }
}

/// Parses an IPv6 header at `offset` and the extension headers behind it, up to the L4
/// header. `None` for a chain cut short; a chain too long comes back not `walked_whole`.
#[inline(always)]
pub fn ipv6_at(ctx: &TcContext, offset: usize) -> Option<Packet<[u8; 16]>> {
    if offset > MAX_IP_OFF || masq_walk_ipv6(ctx.skb.skb, offset as u32) == 0 {
        return None;
    }
    let mut packet = *maps::IPV6_WALK.get(0)?;
    // Copied back through memory, the offsets have lost their bounds for the verifier: give
    // them back, or no read at them passes.
    packet.ip_off = offset;
    (packet.l4_off <= MAX_L4_OFF).then_some(packet)
}

/// Where an IPv6 header may start: the frame's own, or one an ICMPv6 error quotes.
const MAX_IP_OFF: usize = MAX_L4_OFF + 8;

/// The walk behind `ipv6_at`, a global BPF function: the verifier walks it once, on its own,
/// where it walked a static one again at each of the fifteen places and states the programs
/// parse an IPv6 header in. A global function returns one register and takes no pointer but
/// the skb before Linux 5.12: the packet comes back in this CPU's slot of `ipv6_walk`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_walk_ipv6(skb: *mut __sk_buff, offset: u32) -> i64 {
    let ctx = TcContext::new(skb);
    let offset = offset as usize;
    if offset > MAX_IP_OFF {
        return 0;
    }
    match (ipv6_headers(&ctx, offset), maps::IPV6_WALK.get_ptr_mut(0)) {
        (Some(packet), Some(slot)) => {
            // SAFETY: this CPU's slot of a per-CPU map, read back by `ipv6_at` before any
            // other walk on this CPU.
            unsafe { *slot = packet };
            1
        }
        _ => 0,
    }
}

#[inline(always)]
fn ipv6_headers(ctx: &TcContext, offset: usize) -> Option<Packet<[u8; 16]>> {
    // From the linear data only: the helper's fallback would add its frame to the deepest
    // chain of calls (an ICMPv6 error's quoted header), past the verifier's 512 bytes. The
    // kernel keeps IP headers in the linear data; a packet where it did not passes untouched.
    let header: Ipv6Header = read_linear(ctx, offset)?;
    if header.version_class_flow[0] >> 4 != 6 {
        return None;
    }
    let mut fragment = Fragment {
        id: 0,
        first: false,
        later: false,
    };
    let mut proto = header.next_header;
    let mut l4_off = offset + IPV6_HLEN;
    let mut walked = 0;
    let mut walked_whole = true;
    // Past a later fragment's header lies payload, not more headers.
    while !fragment.later {
        let len = match proto {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST => {
                let [_, units]: [u8; 2] = read(ctx, l4_off)?;
                (usize::from(units) + 1) * 8
            }
            // AH counts its length in 4-byte units, less two.
            NEXTHDR_AUTH => {
                let [_, units]: [u8; 2] = read(ctx, l4_off)?;
                (usize::from(units) + 2) * 4
            }
            NEXTHDR_FRAGMENT => {
                let header: [u8; 8] = read(ctx, l4_off)?;
                let offset_flags = u16::from_be_bytes([header[2], header[3]]);
                fragment = Fragment {
                    id: u32::from_ne_bytes([header[4], header[5], header[6], header[7]]),
                    first: offset_flags & 0xfff8 == 0 && offset_flags & 1 == 1,
                    later: offset_flags & 0xfff8 != 0,
                };
                8
            }
            _ => break,
        };
        if walked == MAX_EXTENSION_HEADERS {
            walked_whole = false;
            break;
        }
        walked += 1;
        proto = read(ctx, l4_off)?;
        l4_off += len;
    }
    // Every path through the extension headers ends at an offset of its own.
    let l4_off = verifier::forget(ctx, l4_off as u32) as usize;
    if l4_off > MAX_L4_OFF {
        return None;
    }
    Some(Packet {
        ip_off: offset,
        saddr: header.saddr,
        daddr: header.daddr,
        proto,
        l4_off,
        ip_check: 0,
        fragment,
        walked_whole,
    })
}

/// The pair of 16-bit words at the start of an L4 header: ports for TCP and UDP; for ICMP, the
/// type and code, then the checksum.
#[inline(always)]
pub fn l4_words(ctx: &TcContext, offset: usize) -> Option<(u16, u16)> {
    let words: [u16; 2] = read(ctx, offset)?;
    Some((words[0], words[1]))
}

/// What identifies a flow at L4: ports, or for ICMP echo its identifier.
pub struct L4 {
    pub proto: u8,
    /// Network byte order. For ICMP: the echo identifier.
    pub sport: u16,
    /// Network byte order. For ICMP: 0.
    pub dport: u16,
    /// ICMP type; 0 for TCP and UDP.
    pub icmp_type: u8,
}

/// What a TCP header says of its segment, in host byte order.
#[derive(Clone, Copy)]
pub struct TcpHeader {
    pub seq: u32,
    pub ack: u32,
    /// The header's length in bytes, options included.
    pub len: u8,
    pub flags: u8,
}

/// The TCP header from its sequence number to its flags, as laid out on the wire.
#[repr(C)]
#[derive(Clone, Copy)]
struct TcpHeaderFields {
    seq: u32,
    ack: u32,
    data_offset: u8,
    flags: u8,
}

/// Reads the TCP header at `offset`, which `l4` found whole. Only the packets of TCP flows
/// need it, so the other packets, and every stack frame that holds an `L4`, do without.
#[inline(always)]
pub fn tcp_header(ctx: &TcContext, offset: usize) -> Option<TcpHeader> {
    let fields: TcpHeaderFields = read(ctx, offset + TCP_SEQ_OFF)?;
    Some(TcpHeader {
        seq: u32::from_be(fields.seq),
        ack: u32::from_be(fields.ack),
        len: (fields.data_offset >> 4) * 4,
        flags: fields.flags,
    })
}

/// The flags of the TCP header at `offset`, which `l4` found whole: one byte, for a step that
/// needs no more of the header.
#[inline(always)]
pub fn tcp_flags(ctx: &TcContext, offset: usize) -> Option<u8> {
    read(
        ctx,
        offset + TCP_SEQ_OFF + core::mem::offset_of!(TcpHeaderFields, flags),
    )
}

/// What an ICMP error must quote of the offending packet's L4 header (RFC 792).
const QUOTED_L4_LEN: usize = 8;

/// The shortest header of each protocol: what must be present for it to be rewritten.
#[inline(always)]
fn min_header_len(proto: u8) -> usize {
    match proto {
        IPPROTO_TCP => 20,
        _ => 8,
    }
}

/// Reads the L4 header at `offset` for `proto`; `None` if truncated or not TCP, UDP, ICMP or
/// ICMPv6.
#[inline(always)]
pub fn l4(ctx: &TcContext, offset: usize, proto: u8) -> Option<L4> {
    if (ctx.len() as usize) < offset + min_header_len(proto) {
        return None;
    }
    quoted_l4(ctx, offset, proto)
}

/// Like `l4`, but reads only the first 8 bytes of the header, all an ICMP error is sure to
/// quote. A quote shorter than that is malformed, and not translated,
/// as conntrack would not.
#[inline(always)]
pub fn quoted_l4(ctx: &TcContext, offset: usize, proto: u8) -> Option<L4> {
    if (ctx.len() as usize) < offset + QUOTED_L4_LEN {
        return None;
    }
    let (sport, dport, icmp_type) = match proto {
        IPPROTO_TCP | IPPROTO_UDP => {
            let (sport, dport) = l4_words(ctx, offset)?;
            (sport, dport, 0)
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let icmp_type: u8 = read(ctx, offset)?;
            let id: u16 = read(ctx, offset + ICMP_ID_OFF)?;
            (id, 0, icmp_type)
        }
        _ => return None,
    };
    Some(L4 {
        proto,
        sport,
        dport,
        icmp_type,
    })
}

/// Offset of the checksum field within the L4 header.
#[inline(always)]
pub fn l4_csum_off(proto: u8) -> usize {
    match proto {
        IPPROTO_TCP => TCP_CSUM_OFF,
        IPPROTO_UDP => UDP_CSUM_OFF,
        _ => ICMP_CSUM_OFF,
    }
}

//! Header parsing. Headers are read straight from the packet's linear data, bounds-checked;
//! only what lies past it (a header in a paged fragment) is fetched with `bpf_skb_load_bytes`.
//! A short packet yields `None` rather than a verifier failure or a misread.
//!
//! Reads never write: a program that writes packet data directly has every cloned skb
//! unshared at entry, translated or not, so all writes go through the store helpers instead.

use aya_ebpf::programs::TcContext;
use masq_ebpf::{IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
/// Only option-less IPv4 headers are translated; packets with IP options pass untouched.
pub const IPV4_HLEN: usize = 20;
pub const IPV4_CSUM_OFF: usize = ETH_HLEN + 10;
/// Where the L4 header starts, given an option-less IPv4 header.
pub const L4_OFF: usize = ETH_HLEN + IPV4_HLEN;
const IP_OFFSET: u16 = 0x1fff;
const IP_MORE_FRAGMENTS: u16 = 0x2000;

pub const TCP_CSUM_OFF: usize = 16;
pub const UDP_CSUM_OFF: usize = 6;
pub const ICMP_CSUM_OFF: usize = 2;
pub const ICMP_ID_OFF: usize = 4;
pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_ECHO_REQUEST: u8 = 8;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
const TCP_FLAGS_OFF: usize = 13;

/// An option-less IPv4 header, as laid out on the wire.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Header {
    pub version_ihl: u8,
    pub tos: u8,
    pub total_len: u16,
    pub id: u16,
    pub frag: u16,
    pub ttl: u8,
    pub protocol: u8,
    pub check: u16,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
}

impl Ipv4Header {
    /// A fragment other than the first carries no L4 header.
    #[inline(always)]
    pub fn is_later_fragment(&self) -> bool {
        u16::from_be(self.frag) & IP_OFFSET != 0
    }

    /// The first fragment of a fragmented datagram: it carries the L4 header for all of them.
    #[inline(always)]
    pub fn is_first_fragment(&self) -> bool {
        u16::from_be(self.frag) & (IP_MORE_FRAGMENTS | IP_OFFSET) == IP_MORE_FRAGMENTS
    }
}

/// The `T` at `offset` in the packet.
#[inline(always)]
pub fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let start = ctx.data() + offset;
    if start + size_of::<T>() <= ctx.data_end() {
        // SAFETY: the bytes lie within the linear data, checked just above.
        Some(unsafe { (start as *const T).read_unaligned() })
    } else {
        ctx.load(offset).ok()
    }
}

/// Parses an Ethernet frame carrying an option-less IPv4 header at offset `ETH_HLEN`.
#[inline(always)]
pub fn ipv4(ctx: &TcContext) -> Option<Ipv4Header> {
    if u16::from_be(read::<u16>(ctx, 12)?) != ETH_P_IP {
        return None;
    }
    ipv4_at(ctx, ETH_HLEN)
}

/// Parses an option-less IPv4 header at `offset` (also the one quoted inside ICMP errors).
#[inline(always)]
pub fn ipv4_at(ctx: &TcContext, offset: usize) -> Option<Ipv4Header> {
    let header: Ipv4Header = read(ctx, offset)?;
    (header.version_ihl == 0x45).then_some(header)
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
    /// TCP flags byte; 0 for UDP and ICMP.
    pub tcp_flags: u8,
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

/// Reads the L4 header at `offset` for `proto`; `None` if truncated or not TCP, UDP or ICMP.
#[inline(always)]
pub fn l4(ctx: &TcContext, offset: usize, proto: u8) -> Option<L4> {
    if (ctx.len() as usize) < offset + min_header_len(proto) {
        return None;
    }
    let tcp_flags = if proto == IPPROTO_TCP {
        read(ctx, offset + TCP_FLAGS_OFF)?
    } else {
        0
    };
    quoted_l4(ctx, offset, proto).map(|l4| L4 { tcp_flags, ..l4 })
}

/// Like `l4`, but reads only the first 8 bytes of the header, all an ICMP error is sure to quote,
/// and so leaves `tcp_flags` at 0. A quote shorter than that is malformed, and not translated,
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
        IPPROTO_ICMP => {
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
        tcp_flags: 0,
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

//! Checksum rewriting. The outer headers go through the kernel's csum helpers, which know the
//! skb's offload state (`CHECKSUM_PARTIAL` keeps only the pseudo-header sum in the field;
//! `CHECKSUM_COMPLETE` must see pseudo-header changes). The headers quoted inside ICMP errors
//! are plain data, so their checksums are updated here with RFC 1624 arithmetic.
//!
//! Every value passed around is the raw field as loaded from the packet (network byte order
//! reinterpreted as native): one's-complement sums are byte-order agnostic as long as all words
//! share one order.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use masq_ebpf::IPPROTO_UDP;

use crate::parse::{IPV4_CSUM_OFF, Ipv4Header};

/// Bits of `bpf_l4_csum_replace`'s flags that hold the field size.
const SIZE_4: u64 = 4;
const SIZE_2: u64 = 2;

/// Flags for an L4 checksum update. A UDP checksum of 0 means "none" and must stay 0
/// (`BPF_F_MARK_MANGLED_0` also turns a computed 0 into 0xffff).
#[inline(always)]
fn l4_flags(proto: u8) -> u64 {
    if proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Which address of an IPv4 header a translation rewrites.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum AddrField {
    Source,
    Destination,
}

impl AddrField {
    #[inline(always)]
    pub fn of(self, ip: &Ipv4Header) -> [u8; 4] {
        match self {
            AddrField::Source => ip.saddr,
            AddrField::Destination => ip.daddr,
        }
    }
}

/// The IPv4 header's checksum and both addresses, as laid out from `IPV4_CSUM_OFF`: one store
/// rewrites an address together with the checksum that covers it.
#[repr(C)]
#[derive(Clone, Copy)]
struct ChecksumAndAddresses {
    check: u16,
    saddr: [u8; 4],
    daddr: [u8; 4],
}

/// Rewrites one address of `ip` to `new`, with the IP header checksum and, when `l4_csum_off`
/// is given, the TCP or UDP checksum whose pseudo-header covers it.
///
/// The IP header checksum is plain arithmetic: no offload state covers it, and a valid header
/// sums to the same total before and after, so `CHECKSUM_COMPLETE` needs no update for it.
#[inline(always)]
pub fn rewrite_ipv4_addr(
    ctx: &TcContext,
    ip: &Ipv4Header,
    field: AddrField,
    new: [u8; 4],
    l4_csum_off: Option<(usize, u8)>,
) -> Result<(), i64> {
    let old = field.of(ip);
    let mut header = ChecksumAndAddresses {
        check: replace_dword(ip.check, old, new),
        saddr: ip.saddr,
        daddr: ip.daddr,
    };
    match field {
        AddrField::Source => header.saddr = new,
        AddrField::Destination => header.daddr = new,
    }
    if let Some((csum_off, proto)) = l4_csum_off {
        ctx.l4_csum_replace(
            csum_off,
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(new) as u64,
            BPF_F_PSEUDO_HDR as u64 | l4_flags(proto) | SIZE_4,
        )?;
    }
    ctx.store(IPV4_CSUM_OFF, &header, 0)
}

/// Rewrites a 16-bit L4 field (a port or an ICMP echo identifier) covered by the L4 checksum at
/// `csum_off`.
#[inline(always)]
pub fn rewrite_l4_word(
    ctx: &TcContext,
    field_off: usize,
    csum_off: usize,
    proto: u8,
    old: u16,
    new: u16,
) -> Result<(), i64> {
    ctx.l4_csum_replace(csum_off, old as u64, new as u64, l4_flags(proto) | SIZE_2)?;
    ctx.store(field_off, &new, 0)
}

/// RFC 1624, eqn. 3: the checksum after a 16-bit word of the covered data changed.
#[inline(always)]
pub fn replace_word(check: u16, old: u16, new: u16) -> u16 {
    let sum = (!check as u32) + (!old as u32) + (new as u32);
    !fold(sum)
}

/// The checksum after a 32-bit value of the covered data changed.
#[inline(always)]
pub fn replace_dword(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let halves = |v: [u8; 4]| {
        (
            u16::from_ne_bytes([v[0], v[1]]),
            u16::from_ne_bytes([v[2], v[3]]),
        )
    };
    let ((old_hi, old_lo), (new_hi, new_lo)) = (halves(old), halves(new));
    replace_word(replace_word(check, old_hi, new_hi), old_lo, new_lo)
}

#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

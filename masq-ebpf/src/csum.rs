//! Checksum rewriting. The outer headers go through the kernel's csum helpers, which know the
//! skb's offload state (`CHECKSUM_PARTIAL` keeps only the pseudo-header sum in the field;
//! `CHECKSUM_COMPLETE` must see pseudo-header changes). The headers quoted inside ICMP errors
//! are plain data, so their checksums are updated here with RFC 1624 arithmetic.
//!
//! Every value passed around is the raw field as loaded from the packet (network byte order
//! reinterpreted as native): one's-complement sums are byte-order agnostic as long as all words
//! share one order.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use masq_ebpf::{Address, IPPROTO_UDP};

use crate::{
    hint,
    parse::{IPV4_CSUM_OFF, IPV4_HLEN, IPV6_DADDR_OFF, IPV6_SADDR_OFF, Packet},
    verifier,
};

/// Bits of `bpf_l4_csum_replace`'s flags that hold the field size; 0 passes a checksum
/// difference instead of the old and new values.
const SIZE_4: u64 = 4;
const SIZE_2: u64 = 2;
const SIZE_DIFF: u64 = 0;

/// Where an L4 checksum whose pseudo-header covers the addresses sits, and whose it is.
#[derive(Clone, Copy)]
pub struct L4Checksum {
    pub off: usize,
    pub proto: u8,
}

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

/// Which address of an IP header a translation rewrites.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum AddrField {
    Source,
    Destination,
}

impl AddrField {
    #[inline(always)]
    pub fn of<A: Copy>(self, ip: &Packet<A>) -> A {
        match self {
            AddrField::Source => ip.saddr,
            AddrField::Destination => ip.daddr,
        }
    }

    /// The address at the other end.
    #[inline(always)]
    pub fn other(self) -> AddrField {
        match self {
            AddrField::Source => AddrField::Destination,
            AddrField::Destination => AddrField::Source,
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

/// `ChecksumAndAddresses` and the TCP or UDP ports right behind a 20-byte IPv4 header: one
/// store rewrites an address and a port (a helper call less for each translated packet).
#[repr(C)]
#[derive(Clone, Copy)]
struct ChecksumAddressesAndPorts {
    header: ChecksumAndAddresses,
    ports: Ports,
}

/// A TCP or UDP header's ports, network byte order, as they are to be.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ports {
    pub sport: u16,
    pub dport: u16,
}

/// Rewrites one address of `ip` to `new`, with the IP header checksum and, when `l4_csum` is
/// given, the TCP or UDP checksum whose pseudo-header covers it. `ports`, given for TCP and
/// UDP, are stored with the header when they follow it directly; says whether they were.
///
/// The IP header checksum is plain arithmetic: no offload state covers it, and a valid header
/// sums to the same total before and after, so `CHECKSUM_COMPLETE` needs no update for it.
#[inline(always)]
pub fn rewrite_ipv4_addr(
    ctx: &TcContext,
    ip: &Packet<[u8; 4]>,
    field: AddrField,
    new: [u8; 4],
    l4_csum: Option<L4Checksum>,
    ports: Option<Ports>,
) -> Result<bool, i64> {
    let old = field.of(ip);
    let mut header = ChecksumAndAddresses {
        check: replace_dword(ip.ip_check, old, new),
        saddr: ip.saddr,
        daddr: ip.daddr,
    };
    match field {
        AddrField::Source => header.saddr = new,
        AddrField::Destination => header.daddr = new,
    }
    if let Some(csum) = l4_csum {
        hint::rarely_failing(ctx.l4_csum_replace(
            csum.off,
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(new) as u64,
            BPF_F_PSEUDO_HDR as u64 | l4_flags(csum.proto) | SIZE_4,
        ))?;
    }
    let at = ip.ip_off + IPV4_CSUM_OFF;
    hint::rarely_failing(match ports {
        Some(ports) if ip.l4_off == ip.ip_off + IPV4_HLEN => ctx
            .store(at, &ChecksumAddressesAndPorts { header, ports }, 0)
            .map(|()| true),
        _ => ctx.store(at, &header, 0).map(|()| false),
    })
}

/// Rewrites one address of the IPv6 header `ip` to `new`, and, when `l4_csum` is given, the L4
/// checksum whose pseudo-header covers it (ICMPv6's too).
///
/// With no header checksum to balance it, the address change alters the packet's sum: under
/// `CHECKSUM_COMPLETE` the store must carry it into `skb->csum`, which the pseudo-header update
/// of the L4 checksum moves the other way (the kernel's `BPF_F_IPV6` does the same, but only
/// on kernels from 6.16).
#[inline(always)]
pub fn rewrite_ipv6_addr(
    ctx: &TcContext,
    ip: &Packet<[u8; 16]>,
    field: AddrField,
    new: [u8; 16],
    l4_csum: Option<L4Checksum>,
) -> Result<(), i64> {
    let addr_off = ip.ip_off
        + match field {
            AddrField::Source => IPV6_SADDR_OFF,
            AddrField::Destination => IPV6_DADDR_OFF,
        };
    verifier::result(store_ipv6_addr(
        ctx,
        addr_off,
        &field.of(ip),
        &new,
        l4_csum.as_ref(),
    ))
}

/// A function of its own, called with references and returning the helpers' error code (a
/// BPF function takes five registers, and nothing on the stack): sixteen-byte addresses copied
/// around inline would overflow the programs' 512-byte stack.
#[inline(never)]
fn store_ipv6_addr(
    ctx: &TcContext,
    addr_off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
    l4_csum: Option<&L4Checksum>,
) -> i64 {
    if let Some(csum) = l4_csum {
        let diff = addr_diff(*old, *new, 0);
        let flags = BPF_F_PSEUDO_HDR as u64 | l4_flags(csum.proto) | SIZE_DIFF;
        if let Err(err) = ctx.l4_csum_replace(csum.off, 0, u64::from(diff), flags) {
            return err;
        }
    }
    verifier::code(ctx.store(addr_off, new, BPF_F_RECOMPUTE_CSUM as u64))
}

/// The `i`-th 32-bit word of `addr`.
#[inline(always)]
fn dword<A: Address>(addr: &A, i: usize) -> [u8; 4] {
    let bytes = addr.as_ref();
    let at = |j: usize| bytes.get(4 * i + j).copied().unwrap_or(0);
    [at(0), at(1), at(2), at(3)]
}

/// Updates the L4 checksum at `csum_off` for a 16-bit field it covers (a port or an ICMP echo
/// identifier) going from `old` to `new`; the field itself is stored apart.
#[inline(always)]
pub fn replace_l4_word(
    ctx: &TcContext,
    csum_off: usize,
    proto: u8,
    old: u16,
    new: u16,
) -> Result<(), i64> {
    hint::rarely_failing(ctx.l4_csum_replace(
        csum_off,
        old as u64,
        new as u64,
        l4_flags(proto) | SIZE_2,
    ))
}

/// RFC 1624, eqn. 3: the checksum after a 16-bit word of the covered data changed.
#[inline(always)]
pub fn replace_word(check: u16, old: u16, new: u16) -> u16 {
    let sum = (!check as u32) + (!old as u32) + (new as u32);
    !fold(sum)
}

/// The checksum after an address in the covered data changed. An IPv4 address is two words
/// of arithmetic; an IPv6 address goes to the kernel's `bpf_csum_diff`, which sums it without
/// the eight words' worth of registers the verifier would see spilled.
#[inline(always)]
pub fn replace_addr<A: Address>(check: u16, old: A, new: A) -> u16 {
    if A::BITS == 32 {
        return replace_dword(check, dword(&old, 0), dword(&new, 0));
    }
    !fold(addr_diff(old, new, u32::from(!check)))
}

/// `seed` plus what changing `old` to `new` adds to a one's-complement sum, unfolded, from the
/// kernel's `bpf_csum_diff`.
#[inline(always)]
fn addr_diff<A: Address>(mut old: A, mut new: A, seed: u32) -> u32 {
    let len = old.as_ref().len() as u32;
    // SAFETY: both buffers are `len` bytes on the stack, a multiple of four.
    let sum = unsafe {
        bpf_csum_diff(
            old.as_mut().as_mut_ptr().cast(),
            len,
            new.as_mut().as_mut_ptr().cast(),
            len,
            seed,
        )
    };
    sum as u32
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

//! The builders and checks written once over the address family.

use super::segment::{
    ICMP, TCP, UDP, checksum, l4_checksum_offset, segment_without_checksum, word,
};

use std::{fmt, net::IpAddr};

/// An address family as the frames built here lay it out, implemented by the family's address
/// type: a builder's family follows from the addresses it is given, and a test written once
/// over `A: FrameAddress` runs over both, as the programs are written once over their `Family`.
pub trait FrameAddress: Copy + Eq + fmt::Debug + fmt::Display + Into<IpAddr> + 'static {
    /// The family's ICMP: its protocol number, and its echo request and reply types.
    const ICMP: u8;
    const ECHO_REQUEST: u8;
    const ECHO_REPLY: u8;
    /// The length of an address, and of the IP header of the frames built here (no options,
    /// no extension headers), which starts right behind the Ethernet header.
    const ADDR_LEN: usize;
    const IP_HLEN: usize;
    /// Where the source and destination addresses sit in the frames built here.
    const SRC: usize;
    const DST: usize;
    /// Where the upper layer starts in the frames built here.
    const L4: usize = IP + Self::IP_HLEN;
    /// Where the IP header's own checksum sits, in the family that has one.
    const IP_CHECKSUM: Option<usize>;
    /// Whether a UDP checksum of 0 means "none" (IPv4) rather than an invalid one (IPv6).
    const UDP_CHECKSUM_OPTIONAL: bool;

    /// The address at `off` in `f`.
    fn at(f: &[u8], off: usize) -> Self;
    fn to_bytes(self) -> Vec<u8>;
    fn pseudo_header(src: Self, dst: Self, proto: u8, len: usize) -> Vec<u8>;
    /// An Ethernet frame carrying the upper layer `l4` of protocol `proto`.
    fn frame(src: Self, dst: Self, proto: u8, l4: &[u8]) -> Vec<u8>;
    /// A frame carrying `chunk`, the slice of an upper-layer datagram that `at` places.
    fn fragment(src: Self, dst: Self, proto: u8, chunk: &[u8], at: FragmentAt) -> Vec<u8>;
    /// The IP packet whose header starts at `ip` in `f`, or `None` if it is not of this family
    /// or cut short.
    fn packet_at(f: &[u8], ip: usize) -> Option<IpPacket<Self>>;
    /// Whether the IP header at `ip` carries a valid checksum of its own (IPv6 has none).
    fn header_checksum_ok(f: &[u8], ip: usize) -> bool;
}

/// Where the IP header starts in the frames built here, behind the Ethernet header.
pub const IP: usize = 14;

/// An IP packet's header, as `FrameAddress::packet_at` read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpPacket<A> {
    pub src: A,
    pub dst: A,
    /// The upper-layer protocol, past any extension headers.
    pub proto: u8,
    /// Where the upper layer (in a later fragment: its slice of the datagram) starts.
    pub l4: usize,
    /// A fragment that holds only part of its datagram.
    pub partial: bool,
}

/// Where a fragment's slice sits in its datagram.
#[derive(Clone, Copy, Debug)]
pub struct FragmentAt {
    /// In eight-byte units.
    pub offset: u16,
    /// More of the datagram follows.
    pub more: bool,
    pub id: u32,
}

/// The upper-layer checksum residual of `seg` from `src` to `dst`: 0 when the checksum is
/// valid. Every upper layer sums the pseudo-header but ICMPv4's.
pub fn residual<A: FrameAddress>(src: A, dst: A, proto: u8, seg: &[u8]) -> u16 {
    if proto == ICMP {
        return checksum(seg);
    }
    checksum(&[A::pseudo_header(src, dst, proto, seg.len()), seg.to_vec()].concat())
}

/// Computes the checksum of the upper layer `seg` (TCP, UDP or the family's ICMP) and stores
/// it in place. A UDP sum of 0 is sent as 0xffff (RFC 768, RFC 8200 §8.1).
pub fn fill_checksum<A: FrameAddress>(src: A, dst: A, proto: u8, seg: &mut [u8]) {
    let off = l4_checksum_offset(proto);
    seg[off..off + 2].copy_from_slice(&[0, 0]);
    let mut c = residual(src, dst, proto, seg);
    if proto == UDP && c == 0 {
        c = 0xffff;
    }
    seg[off..off + 2].copy_from_slice(&c.to_be_bytes());
}

/// A TCP segment (20-byte header) or UDP datagram with a payload and its checksum.
pub fn l4_segment<A: FrameAddress>(
    src: A,
    dst: A,
    proto: u8,
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    let mut s = segment_without_checksum(proto, sport, dport, flags);
    fill_checksum(src, dst, proto, &mut s);
    s
}

/// An Ethernet frame carrying the upper layer `l4` of protocol `proto` from `src` to `dst`.
pub fn frame<A: FrameAddress>(src: A, dst: A, proto: u8, l4: &[u8]) -> Vec<u8> {
    A::frame(src, dst, proto, l4)
}

pub fn tcp<A: FrameAddress>(src: A, sport: u16, dst: A, dport: u16, flags: u8) -> Vec<u8> {
    frame(
        src,
        dst,
        TCP,
        &l4_segment(src, dst, TCP, sport, dport, flags),
    )
}

pub fn udp<A: FrameAddress>(src: A, sport: u16, dst: A, dport: u16) -> Vec<u8> {
    frame(src, dst, UDP, &l4_segment(src, dst, UDP, sport, dport, 0))
}

/// An ICMP or ICMPv6 message: type, code, the four bytes of "rest of header", the body, and
/// its checksum.
pub fn icmp_message<A: FrameAddress>(
    src: A,
    dst: A,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    let mut m = [vec![kind, code, 0, 0], rest.to_vec(), body.to_vec()].concat();
    fill_checksum(src, dst, A::ICMP, &mut m);
    m
}

/// The same in a frame.
pub fn icmp_frame<A: FrameAddress>(
    src: A,
    dst: A,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    frame(
        src,
        dst,
        A::ICMP,
        &icmp_message(src, dst, kind, code, rest, body),
    )
}

/// An echo request or reply message with identifier `id`, sequence 1.
pub fn echo_message<A: FrameAddress>(src: A, dst: A, kind: u8, id: u16) -> Vec<u8> {
    let [a, b] = id.to_be_bytes();
    icmp_message(src, dst, kind, 0, [a, b, 0, 1], b"ping payload")
}

/// The same in a frame.
pub fn ping<A: FrameAddress>(src: A, dst: A, kind: u8, id: u16) -> Vec<u8> {
    frame(src, dst, A::ICMP, &echo_message(src, dst, kind, id))
}

/// The upper-layer `datagram` cut into fragments of `size` bytes (a multiple of 8; the last one
/// takes the rest) with identification `id`, each in a frame of its own, first fragment first.
pub fn fragments<A: FrameAddress>(
    src: A,
    dst: A,
    proto: u8,
    datagram: &[u8],
    id: u32,
    size: usize,
) -> Vec<Vec<u8>> {
    assert!(
        size > 0 && size.is_multiple_of(8),
        "fragments are multiples of 8 bytes"
    );
    let count = datagram.len().div_ceil(size);
    let at = |i: usize| FragmentAt {
        offset: (i * size / 8) as u16,
        more: i + 1 < count,
        id,
    };
    datagram
        .chunks(size)
        .enumerate()
        .map(|(i, chunk)| A::fragment(src, dst, proto, chunk, at(i)))
        .collect()
}

/// Whether the upper layer of `p` in `f` (running to the end of `f`) carries a valid TCP, UDP
/// or ICMP checksum, computed from scratch. False for what cannot be checked on its own: a
/// partial fragment, a header too short to hold its checksum, another protocol, or a UDP
/// checksum of 0 where the family forbids it; a UDP checksum of 0 where it means "none" is
/// true.
pub fn segment_checksum_ok<A: FrameAddress>(f: &[u8], p: &IpPacket<A>) -> bool {
    if p.partial || p.l4 > f.len() {
        return false;
    }
    let seg = &f[p.l4..];
    let min = match p.proto {
        TCP => 20,
        UDP => 8,
        proto if proto == A::ICMP => 4,
        _ => return false,
    };
    if seg.len() < min {
        return false;
    }
    if p.proto == UDP && word(seg, 6) == 0 {
        return A::UDP_CHECKSUM_OPTIONAL;
    }
    residual(p.src, p.dst, p.proto, seg) == 0
}

/// Whether every checksum of the frame's own packet verifies from scratch: the IP header's
/// (IPv4) and the upper layer's.
pub fn checksums_ok<A: FrameAddress>(f: &[u8]) -> bool {
    A::packet_at(f, IP).is_some_and(|p| A::header_checksum_ok(f, IP) && segment_checksum_ok(f, &p))
}

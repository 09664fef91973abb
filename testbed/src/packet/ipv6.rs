//! IPv6 as the frames built here lay it out: the fixed header, extension header chains and
//! their walk, and the ICMPv6 types the tests send.

use super::{
    family::{FragmentAt, FrameAddress, IP, IpPacket},
    segment::word,
};

use std::net::Ipv6Addr;

pub const ICMPV6: u8 = 58;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// The fixed IPv6 header's length.
pub const IPV6_HLEN: usize = 40;
/// Where the source and destination addresses sit in the frames built here.
pub const SRC6: usize = IP + 8;
pub const DST6: usize = IP + 24;
/// Where the L4 header starts in an IPv6 frame without extension headers.
pub const L4_6: usize = <Ipv6Addr as FrameAddress>::L4;

/// Next-header values of the extension headers (RFC 8200 §4, RFC 4302).
pub const NH_HOP_BY_HOP: u8 = 0;
pub const NH_ROUTING: u8 = 43;
pub const NH_FRAGMENT: u8 = 44;
pub const NH_AUTH: u8 = 51;
pub const NH_NO_NEXT: u8 = 59;
pub const NH_DEST_OPTS: u8 = 60;

/// ICMPv6 types (RFC 4443, RFC 4861, RFC 2710 and RFC 3810).
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PACKET_TOO_BIG: u8 = 2;
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;
pub const ICMPV6_PARAMETER_PROBLEM: u8 = 4;
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
pub const ICMPV6_ECHO_REPLY: u8 = 129;
pub const MLD_QUERY: u8 = 130;
pub const MLD_REPORT: u8 = 131;
pub const MLD_DONE: u8 = 132;
pub const ND_ROUTER_SOLICIT: u8 = 133;
pub const ND_ROUTER_ADVERT: u8 = 134;
pub const ND_NEIGHBOR_SOLICIT: u8 = 135;
pub const ND_NEIGHBOR_ADVERT: u8 = 136;
pub const MLD2_REPORT: u8 = 143;

/// The IPv6 pseudo-header (RFC 8200 §8.1): source, destination, the upper-layer packet length
/// as 32 bits, three zero bytes and the upper layer's next-header value.
pub fn pseudo_header6(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend((len as u32).to_be_bytes());
    p.extend([0, 0, 0, next_header]);
    p
}

/// The fixed IPv6 header: traffic class 0, a flow label, hop limit 64.
pub fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, payload_len: usize) -> Vec<u8> {
    let mut h = vec![0x60, 0x01, 0x23, 0x45];
    h.extend((payload_len as u16).to_be_bytes());
    h.extend([next_header, 64]);
    h.extend(src.octets());
    h.extend(dst.octets());
    h
}

/// One IPv6 extension header as it sits in a chain. Its first byte, the next-header field, is
/// filled in when the chain is laid out (`ext_chain`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtHeader {
    /// Its own next-header value: `NH_HOP_BY_HOP`, `NH_ROUTING`, ...
    pub kind: u8,
    pub bytes: Vec<u8>,
}

impl ExtHeader {
    /// Hop-by-hop options, `(units + 1) * 8` bytes, padded with Pad1/PadN options.
    pub fn hop_by_hop(units: u8) -> ExtHeader {
        ExtHeader::options(NH_HOP_BY_HOP, units)
    }

    /// Destination options, `(units + 1) * 8` bytes, padded with Pad1/PadN options.
    pub fn destination_options(units: u8) -> ExtHeader {
        ExtHeader::options(NH_DEST_OPTS, units)
    }

    fn options(kind: u8, units: u8) -> ExtHeader {
        let len = (usize::from(units) + 1) * 8;
        let mut bytes = vec![0, units];
        while bytes.len() < len {
            let room = len - bytes.len();
            if room == 1 {
                bytes.push(0);
            } else {
                let n = (room - 2).min(255);
                bytes.extend([1, n as u8]);
                bytes.extend(std::iter::repeat_n(0, n));
            }
        }
        ExtHeader { kind, bytes }
    }

    /// The hop-by-hop header MLD messages carry: a router alert option (RFC 2711) for MLD, and
    /// a PadN.
    pub fn router_alert() -> ExtHeader {
        ExtHeader {
            kind: NH_HOP_BY_HOP,
            bytes: vec![0, 0, 5, 2, 0, 0, 1, 0],
        }
    }

    /// A routing header, `(units + 1) * 8` bytes, of an experimental type (RFC 4727) with no
    /// segments left: every node ignores it, and the destination address is the final one.
    pub fn routing(units: u8) -> ExtHeader {
        let len = (usize::from(units) + 1) * 8;
        let mut bytes = vec![0, units, 253, 0];
        bytes.resize(len, 0);
        ExtHeader {
            kind: NH_ROUTING,
            bytes,
        }
    }

    /// A fragment header: `offset` in eight-byte units (13 bits), the M flag, the
    /// identification.
    pub fn fragment(offset: u16, more: bool, id: u32) -> ExtHeader {
        let mut bytes = vec![0, 0];
        bytes.extend(((offset << 3) | u16::from(more)).to_be_bytes());
        bytes.extend(id.to_be_bytes());
        ExtHeader {
            kind: NH_FRAGMENT,
            bytes,
        }
    }

    /// An authentication header, `(units + 2) * 4` bytes (RFC 4302).
    pub fn auth(units: u8) -> ExtHeader {
        let len = (usize::from(units) + 2) * 4;
        let mut bytes = vec![0, units, 0, 0, 0, 0, 0x10, 0x01, 0, 0, 0, 1];
        bytes.resize(len.max(12), 0);
        ExtHeader {
            kind: NH_AUTH,
            bytes,
        }
    }

    /// Any bytes at all, announced as `kind`: for malformed chains.
    pub fn raw(kind: u8, bytes: Vec<u8>) -> ExtHeader {
        ExtHeader { kind, bytes }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// `exts` laid out in order, each one's next-header field naming the one after it, the last's
/// naming `upper`. (A header of no bytes at all has no field to fill.)
pub fn ext_chain(exts: &[ExtHeader], upper: u8) -> Vec<u8> {
    let mut chain = Vec::new();
    for (i, ext) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map_or(upper, |e| e.kind);
        let mut bytes = ext.bytes.clone();
        if let Some(first) = bytes.first_mut() {
            *first = next;
        }
        chain.extend(bytes);
    }
    chain
}

/// The Ethernet header of an IPv6 frame: to a multicast MAC (33:33 and the address's last four
/// bytes, RFC 2464) when the destination is multicast.
fn ethernet6(dst: Ipv6Addr) -> Vec<u8> {
    let mut e = if dst.is_multicast() {
        let o = dst.octets();
        vec![0x33, 0x33, o[12], o[13], o[14], o[15]]
    } else {
        vec![0x02, 0, 0, 0, 0, 1]
    };
    e.extend([0x02, 0, 0, 0, 0, 2, 0x86, 0xdd]);
    e
}

/// An Ethernet + IPv6 frame: the fixed header, `exts`, then the upper layer `l4` of protocol
/// `proto`.
pub fn frame6_ext(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    exts: &[ExtHeader],
    proto: u8,
    l4: &[u8],
) -> Vec<u8> {
    let chain = ext_chain(exts, proto);
    let first = exts.first().map_or(proto, |e| e.kind);
    let mut f = ethernet6(dst);
    f.extend(ipv6_header(src, dst, first, chain.len() + l4.len()));
    f.extend(chain);
    f.extend(l4);
    f
}

/// `frame` (Ethernet + IPv6) with `exts` inserted right behind its fixed header, ahead of
/// whatever followed it: the chain is relinked and the payload length grown. The upper layer
/// is untouched, and so is its checksum, which extension headers do not enter.
pub fn insert_ext6(frame: &[u8], exts: &[ExtHeader]) -> Vec<u8> {
    if exts.is_empty() {
        return frame.to_vec();
    }
    let mut f = frame.to_vec();
    let chain = ext_chain(exts, f[IP + 6]);
    f[IP + 6] = exts[0].kind;
    let payload_len = usize::from(word(&f, IP + 4)) + chain.len();
    f[IP + 4..IP + 6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    f.splice(L4_6..L4_6, chain);
    f
}

/// `frame` with its hop limit set to `hops` (255 for neighbour discovery, 1 for MLD).
pub fn with_hop_limit6(frame: &[u8], hops: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[IP + 7] = hops;
    f
}

/// The IPv6 address at `off` in `f`.
pub fn addr6_at(f: &[u8], off: usize) -> Ipv6Addr {
    let mut o = [0u8; 16];
    o.copy_from_slice(&f[off..off + 16]);
    Ipv6Addr::from(o)
}

pub fn src6(f: &[u8]) -> Ipv6Addr {
    addr6_at(f, SRC6)
}

pub fn dst6(f: &[u8]) -> Ipv6Addr {
    addr6_at(f, DST6)
}

/// A fragment header, as `headers6_at` found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frag6 {
    /// Where the fragment header starts.
    pub at: usize,
    /// In eight-byte units.
    pub offset: u16,
    pub more: bool,
    pub id: u32,
}

impl Frag6 {
    /// The whole datagram is in this one frame: offset 0 and no more fragments.
    pub fn is_atomic(&self) -> bool {
        self.offset == 0 && !self.more
    }
}

/// What walking an IPv6 header chain found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Headers6 {
    /// Where the fixed header starts.
    pub ip: usize,
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    /// The upper-layer protocol: the first next-header value that is no extension header
    /// (or, past a later fragment's header, the protocol of the fragment's datagram).
    pub proto: u8,
    /// Where the upper layer (in a later fragment: its slice of the datagram) starts.
    pub l4: usize,
    /// The extension headers walked, in order: (next-header value, offset, length).
    pub exts: Vec<(u8, usize, usize)>,
    pub fragment: Option<Frag6>,
}

impl Headers6 {
    /// A fragment that holds only part of its datagram.
    pub fn is_partial(&self) -> bool {
        self.fragment.is_some_and(|f| !f.is_atomic())
    }

    /// What every family's packet has.
    pub fn packet(&self) -> IpPacket<Ipv6Addr> {
        IpPacket {
            src: self.src,
            dst: self.dst,
            proto: self.proto,
            l4: self.l4,
            partial: self.is_partial(),
        }
    }

    /// A fragment other than the first: its bytes are payload, with no L4 header.
    pub fn is_later_fragment(&self) -> bool {
        self.fragment.is_some_and(|f| f.offset != 0)
    }
}

/// Walks the IPv6 header at `ip` in `f` and the extension headers behind it (hop-by-hop,
/// routing, fragment, destination options, authentication), as far as the chain goes, with no
/// limit of its own on its length. `None` if the fixed header or an extension header is cut
/// short, or the version is not 6. The walk stops behind a later fragment's header: what follows
/// it is payload.
pub fn headers6_at(f: &[u8], ip: usize) -> Option<Headers6> {
    if f.len() < ip + IPV6_HLEN || f[ip] >> 4 != 6 {
        return None;
    }
    let mut h = Headers6 {
        ip,
        src: addr6_at(f, ip + 8),
        dst: addr6_at(f, ip + 24),
        proto: f[ip + 6],
        l4: ip + IPV6_HLEN,
        exts: Vec::new(),
        fragment: None,
    };
    loop {
        let at = h.l4;
        let len = match h.proto {
            NH_HOP_BY_HOP | NH_ROUTING | NH_DEST_OPTS => (usize::from(*f.get(at + 1)?) + 1) * 8,
            NH_AUTH => (usize::from(*f.get(at + 1)?) + 2) * 4,
            NH_FRAGMENT => 8,
            _ => return Some(h),
        };
        if f.len() < at + len {
            return None;
        }
        if h.proto == NH_FRAGMENT {
            let offset_flags = word(f, at + 2);
            h.fragment = Some(Frag6 {
                at,
                offset: offset_flags >> 3,
                more: offset_flags & 1 == 1,
                id: u32::from_be_bytes([f[at + 4], f[at + 5], f[at + 6], f[at + 7]]),
            });
        }
        h.exts.push((h.proto, at, len));
        h.proto = f[at];
        h.l4 = at + len;
        if h.is_later_fragment() {
            return Some(h);
        }
    }
}

/// `headers6_at` for the frame's own IPv6 header; `None` if the frame is not IPv6.
pub fn headers6(f: &[u8]) -> Option<Headers6> {
    if f.len() < IP || word(f, 12) != ETHERTYPE_IPV6 {
        return None;
    }
    headers6_at(f, IP)
}

/// Where the upper layer starts in an IPv6 frame, past its extension headers.
pub fn l4_offset6(f: &[u8]) -> Option<usize> {
    headers6(f).map(|h| h.l4)
}

/// The packet an ICMPv6 error in `f` quotes, walked like the frame's own (it starts 8 bytes
/// into the ICMPv6 message).
pub fn quote6(f: &[u8]) -> Option<Headers6> {
    let outer = headers6(f)?;
    if outer.proto != ICMPV6 {
        return None;
    }
    headers6_at(f, outer.l4 + 8)
}

impl FrameAddress for Ipv6Addr {
    const ICMP: u8 = ICMPV6;
    const ECHO_REQUEST: u8 = ICMPV6_ECHO_REQUEST;
    const ECHO_REPLY: u8 = ICMPV6_ECHO_REPLY;
    const ADDR_LEN: usize = 16;
    const IP_HLEN: usize = IPV6_HLEN;
    const SRC: usize = SRC6;
    const DST: usize = DST6;
    const IP_CHECKSUM: Option<usize> = None;
    const UDP_CHECKSUM_OPTIONAL: bool = false;

    fn at(f: &[u8], off: usize) -> Self {
        addr6_at(f, off)
    }

    fn to_bytes(self) -> Vec<u8> {
        self.octets().to_vec()
    }

    fn pseudo_header(src: Self, dst: Self, proto: u8, len: usize) -> Vec<u8> {
        pseudo_header6(src, dst, proto, len)
    }

    fn frame(src: Self, dst: Self, proto: u8, l4: &[u8]) -> Vec<u8> {
        frame6_ext(src, dst, &[], proto, l4)
    }

    fn fragment(src: Self, dst: Self, proto: u8, chunk: &[u8], at: FragmentAt) -> Vec<u8> {
        let header = ExtHeader::fragment(at.offset, at.more, at.id);
        frame6_ext(src, dst, &[header], proto, chunk)
    }

    fn packet_at(f: &[u8], ip: usize) -> Option<IpPacket<Self>> {
        headers6_at(f, ip).map(|h| h.packet())
    }

    fn header_checksum_ok(_: &[u8], _: usize) -> bool {
        true
    }
}

//! Ethernet + IPv4 and Ethernet + IPv6 frames built from scratch, with checksums computed in
//! full by this module's own code, for the packet tests and the data-path benchmark. Sharing
//! nothing with the eBPF programs' incremental checksum updates is the point: a test that checks
//! a translation with this code checks it independently.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    ops::Range,
};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
/// Where the L4 header starts in the frames built here (Ethernet, option-less IPv4).
pub const L4: usize = <Ipv4Addr as IpFamily>::L4;

fn ones_sum(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

pub fn checksum(data: &[u8]) -> u16 {
    let mut sum = ones_sum(data);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

pub fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend([0, proto]);
    p.extend((len as u16).to_be_bytes());
    p
}

/// An option-less IPv4 header with a correct checksum.
pub fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    payload_len: usize,
    frag: u16,
) -> Vec<u8> {
    let mut h = vec![0x45, 0];
    h.extend(((20 + payload_len) as u16).to_be_bytes());
    h.extend(0x1234u16.to_be_bytes());
    h.extend(frag.to_be_bytes());
    h.extend([64, proto, 0, 0]);
    h.extend(src.octets());
    h.extend(dst.octets());
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

/// The payload of the segments and datagrams built here, unless a test gives one.
const PAYLOAD: &[u8] = b"masq-agent test payload";

/// A TCP segment (20-byte header) or UDP datagram with a payload, its checksum field zero.
fn segment_without_checksum(proto: u8, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    if proto == TCP {
        return Tcp {
            sport,
            dport,
            flags,
            ..Tcp::default()
        }
        .without_checksum();
    }
    let mut s = Vec::new();
    s.extend(sport.to_be_bytes());
    s.extend(dport.to_be_bytes());
    s.extend(((8 + PAYLOAD.len()) as u16).to_be_bytes());
    s.extend([0, 0]);
    s.extend(PAYLOAD);
    s
}

/// A TCP segment with chosen sequence numbers and payload, for the tests of what TCP's
/// sequence space decides.
#[derive(Clone, Copy)]
pub struct Tcp<'a> {
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
    pub seq: u32,
    pub ack: u32,
    pub payload: &'a [u8],
}

impl Default for Tcp<'_> {
    fn default() -> Self {
        Tcp {
            sport: 0,
            dport: 0,
            flags: ACK,
            seq: 1000,
            ack: 0,
            payload: PAYLOAD,
        }
    }
}

impl Tcp<'_> {
    /// The segment, 20-byte header first, its checksum field zero.
    fn without_checksum(&self) -> Vec<u8> {
        let mut s = Vec::new();
        s.extend(self.sport.to_be_bytes());
        s.extend(self.dport.to_be_bytes());
        s.extend(self.seq.to_be_bytes());
        s.extend(self.ack.to_be_bytes());
        s.extend([0x50, self.flags, 0xff, 0xff, 0, 0, 0, 0]);
        s.extend(self.payload);
        s
    }

    /// The segment from `src` to `dst`, its checksum computed over their pseudo-header.
    pub fn segment<A: IpFamily>(&self, src: A, dst: A) -> Vec<u8> {
        let mut seg = self.without_checksum();
        fill_checksum(src, dst, TCP, &mut seg);
        seg
    }

    /// The segment in a frame from `src` to `dst`, checksums computed.
    pub fn frame<A: IpFamily>(&self, src: A, dst: A) -> Vec<u8> {
        frame(src, dst, TCP, &self.segment(src, dst))
    }

    /// The segment alone, for addresses whose family is known only when the test runs.
    pub fn segment_between(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => self.segment(src, dst),
            (IpAddr::V6(src), IpAddr::V6(dst)) => self.segment(src, dst),
            _ => panic!("{src} and {dst} are of two families"),
        }
    }
}

/// An Ethernet + option-less IPv4 frame whose flags and fragment offset field is `frag`.
pub fn frame_with_frag(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8], frag: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend(ipv4_header(src, dst, proto, l4.len(), frag));
    f.extend(l4);
    f
}

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

/// The source address of an option-less IPv4 frame.
pub fn src(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::at(f, Ipv4Addr::SRC)
}

/// Its destination.
pub fn dst(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::at(f, Ipv4Addr::DST)
}

pub fn word(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

// ---- IPv6 -----------------------------------------------------------------------------------

pub const ICMPV6: u8 = 58;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// The fixed IPv6 header's length.
pub const IPV6_HLEN: usize = 40;
/// Where the source and destination addresses sit in the frames built here.
pub const SRC6: usize = IP + 8;
pub const DST6: usize = IP + 24;
/// Where the L4 header starts in an IPv6 frame without extension headers.
pub const L4_6: usize = <Ipv6Addr as IpFamily>::L4;

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

/// Where the checksum of an upper layer of protocol `proto` sits in its header.
pub fn l4_checksum_offset(proto: u8) -> usize {
    match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    }
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

/// RFC 1624 eqn. 3, from scratch: the checksum `check` after the covered bytes `old` became
/// `new` (both of one even length, in place of each other).
pub fn checksum_adjusted(check: u16, old: &[u8], new: &[u8]) -> u16 {
    assert_eq!(old.len(), new.len());
    let inverted: Vec<u8> = old.iter().map(|b| !b).collect();
    let mut sum = u32::from(!check) + ones_sum(&inverted) + ones_sum(new);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Whether two checksum fields are the same one's-complement number: 0x0000 and 0xffff both
/// stand for zero.
pub fn same_checksum(a: u16, b: u16) -> bool {
    a == b || (a | b == 0xffff && a & b == 0 && (a == 0 || b == 0))
}

// ---- either family --------------------------------------------------------------------------

/// An address family as the frames built here lay it out, implemented by the family's address
/// type: a builder's family follows from the addresses it is given, and a test written once
/// over `A: IpFamily` runs over both, as the programs are written once over their `Family`.
pub trait IpFamily: Copy + Eq + fmt::Debug + fmt::Display + Into<IpAddr> + 'static {
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

/// An IP packet's header, as `IpFamily::packet_at` read it.
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

impl IpFamily for Ipv4Addr {
    const ICMP: u8 = ICMP;
    const ECHO_REQUEST: u8 = 8;
    const ECHO_REPLY: u8 = 0;
    const ADDR_LEN: usize = 4;
    const IP_HLEN: usize = 20;
    const SRC: usize = IP + 12;
    const DST: usize = IP + 16;
    const IP_CHECKSUM: Option<usize> = Some(IP + 10);
    const UDP_CHECKSUM_OPTIONAL: bool = true;

    fn at(f: &[u8], off: usize) -> Self {
        Ipv4Addr::new(f[off], f[off + 1], f[off + 2], f[off + 3])
    }

    fn to_bytes(self) -> Vec<u8> {
        self.octets().to_vec()
    }

    fn pseudo_header(src: Self, dst: Self, proto: u8, len: usize) -> Vec<u8> {
        pseudo_header(src, dst, proto, len)
    }

    fn frame(src: Self, dst: Self, proto: u8, l4: &[u8]) -> Vec<u8> {
        frame_with_frag(src, dst, proto, l4, 0)
    }

    fn fragment(src: Self, dst: Self, proto: u8, chunk: &[u8], at: FragmentAt) -> Vec<u8> {
        let frag = at.offset | if at.more { IPV4_MORE_FRAGMENTS } else { 0 };
        let mut f = frame_with_frag(src, dst, proto, chunk, frag);
        // The identification tells datagrams apart; the header checksum is made right again.
        f[IP + 4..IP + 6].copy_from_slice(&(at.id as u16).to_be_bytes());
        f[IP + 10..IP + 12].copy_from_slice(&[0, 0]);
        let c = checksum(&f[IP..IP + 20]);
        f[IP + 10..IP + 12].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn packet_at(f: &[u8], ip: usize) -> Option<IpPacket<Self>> {
        let first = *f.get(ip)?;
        let hlen = usize::from(first & 0x0f) * 4;
        if first >> 4 != 4 || hlen < 20 || f.len() < ip + hlen {
            return None;
        }
        let frag = word(f, ip + 6);
        Some(IpPacket {
            src: Self::at(f, ip + 12),
            dst: Self::at(f, ip + 16),
            proto: f[ip + 9],
            l4: ip + hlen,
            partial: frag & (IPV4_MORE_FRAGMENTS | IPV4_OFFSET_MASK) != 0,
        })
    }

    fn header_checksum_ok(f: &[u8], ip: usize) -> bool {
        let hlen = usize::from(f[ip] & 0x0f) * 4;
        checksum(&f[ip..ip + hlen]) == 0
    }
}

impl IpFamily for Ipv6Addr {
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

/// IPv4's flags-and-offset field: more fragments, and the offset in eight-byte units.
pub const IPV4_MORE_FRAGMENTS: u16 = 0x2000;
pub const IPV4_OFFSET_MASK: u16 = 0x1fff;

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
pub fn residual<A: IpFamily>(src: A, dst: A, proto: u8, seg: &[u8]) -> u16 {
    if proto == ICMP {
        return checksum(seg);
    }
    checksum(&[A::pseudo_header(src, dst, proto, seg.len()), seg.to_vec()].concat())
}

/// Computes the checksum of the upper layer `seg` (TCP, UDP or the family's ICMP) and stores
/// it in place. A UDP sum of 0 is sent as 0xffff (RFC 768, RFC 8200 §8.1).
pub fn fill_checksum<A: IpFamily>(src: A, dst: A, proto: u8, seg: &mut [u8]) {
    let off = l4_checksum_offset(proto);
    seg[off..off + 2].copy_from_slice(&[0, 0]);
    let mut c = residual(src, dst, proto, seg);
    if proto == UDP && c == 0 {
        c = 0xffff;
    }
    seg[off..off + 2].copy_from_slice(&c.to_be_bytes());
}

/// A TCP segment (20-byte header) or UDP datagram with a payload and its checksum.
pub fn l4_segment<A: IpFamily>(
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
pub fn frame<A: IpFamily>(src: A, dst: A, proto: u8, l4: &[u8]) -> Vec<u8> {
    A::frame(src, dst, proto, l4)
}

pub fn tcp<A: IpFamily>(src: A, sport: u16, dst: A, dport: u16, flags: u8) -> Vec<u8> {
    frame(
        src,
        dst,
        TCP,
        &l4_segment(src, dst, TCP, sport, dport, flags),
    )
}

pub fn udp<A: IpFamily>(src: A, sport: u16, dst: A, dport: u16) -> Vec<u8> {
    frame(src, dst, UDP, &l4_segment(src, dst, UDP, sport, dport, 0))
}

/// An ICMP or ICMPv6 message: type, code, the four bytes of "rest of header", the body, and
/// its checksum.
pub fn icmp_message<A: IpFamily>(
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
pub fn icmp_frame<A: IpFamily>(
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
pub fn echo_message<A: IpFamily>(src: A, dst: A, kind: u8, id: u16) -> Vec<u8> {
    let [a, b] = id.to_be_bytes();
    icmp_message(src, dst, kind, 0, [a, b, 0, 1], b"ping payload")
}

/// The same in a frame.
pub fn ping<A: IpFamily>(src: A, dst: A, kind: u8, id: u16) -> Vec<u8> {
    frame(src, dst, A::ICMP, &echo_message(src, dst, kind, id))
}

/// The upper-layer `datagram` cut into fragments of `size` bytes (a multiple of 8; the last one
/// takes the rest) with identification `id`, each in a frame of its own, first fragment first.
pub fn fragments<A: IpFamily>(
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
pub fn segment_checksum_ok<A: IpFamily>(f: &[u8], p: &IpPacket<A>) -> bool {
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
pub fn checksums_ok<A: IpFamily>(f: &[u8]) -> bool {
    A::packet_at(f, IP).is_some_and(|p| A::header_checksum_ok(f, IP) && segment_checksum_ok(f, &p))
}

// ---- checking what came out ----------------------------------------------------------------

/// The byte offsets at which two frames of one length differ.
pub fn diff(a: &[u8], b: &[u8]) -> Vec<usize> {
    assert_eq!(a.len(), b.len(), "frame length changed");
    (0..a.len()).filter(|&i| a[i] != b[i]).collect()
}

/// `len` bytes from `at`.
pub fn range(at: usize, len: usize) -> Range<usize> {
    at..at + len
}

/// Every byte that differs between `input` and `out` lies in `allowed`.
pub fn assert_changed_within(input: &[u8], out: &[u8], allowed: &[Range<usize>]) {
    for i in diff(input, out) {
        assert!(
            allowed.iter().any(|r| r.contains(&i)),
            "byte {i} changed ({:#04x} -> {:#04x}), outside {allowed:?}",
            input[i],
            out[i]
        );
    }
}

/// `out` is `expected` byte for byte, except that the 16-bit checksum fields at `csums` may
/// hold either form of one's-complement zero.
pub fn assert_frame(out: &[u8], expected: &[u8], csums: &[usize]) {
    assert_eq!(out.len(), expected.len(), "frame length");
    let wrong: Vec<usize> = (0..out.len())
        .filter(|&i| !csums.iter().any(|&c| (c..c + 2).contains(&i)) && out[i] != expected[i])
        .collect();
    assert!(
        wrong.is_empty(),
        "bytes {wrong:?} differ from the expected frame\n     got: {out:02x?}\nexpected: {expected:02x?}"
    );
    for &c in csums {
        assert!(
            same_checksum(word(out, c), word(expected, c)),
            "checksum at {c}: {:#06x}, expected {:#06x}",
            word(out, c),
            word(expected, c)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
    const B: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);

    #[test]
    fn ipv6_checksums_match_known_answers() {
        // Both checked with `tcpdump -vv`, which verifies them with code of its own.
        assert_eq!(word(&tcp(A, 40000, B, 80, SYN), L4_6 + 16), 0x46ec);
        let f = tcp(A, 40000, B, 80, SYN);
        assert!(checksums_ok::<Ipv6Addr>(&f));
        for i in L4_6..f.len() {
            let mut broken = f.clone();
            broken[i] ^= 0x01;
            assert!(
                !checksums_ok::<Ipv6Addr>(&broken),
                "a flipped bit at {i} goes unnoticed"
            );
        }
        // The pseudo-header counts: another address breaks the checksum.
        let mut moved = f.clone();
        moved[SRC6 + 15] ^= 1;
        assert!(!checksums_ok::<Ipv6Addr>(&moved));
        assert!(checksums_ok::<Ipv6Addr>(&udp(A, 1, B, 2)));
        assert!(checksums_ok::<Ipv6Addr>(&ping(
            A,
            B,
            ICMPV6_ECHO_REQUEST,
            7
        )));
    }

    #[test]
    fn ipv4_checksums_are_checked_from_scratch() {
        let (a, b) = (Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(203, 0, 113, 10));
        for f in [
            tcp(a, 40000, b, 80, SYN),
            udp(a, 1, b, 2),
            ping(a, b, Ipv4Addr::ECHO_REQUEST, 7),
        ] {
            assert!(checksums_ok::<Ipv4Addr>(&f));
            for i in IP..f.len() {
                let mut broken = f.clone();
                broken[i] ^= 0x01;
                assert!(
                    !checksums_ok::<Ipv4Addr>(&broken),
                    "a flipped bit at {i} goes unnoticed"
                );
            }
        }
        let mut no_checksum = udp(a, 1, b, 2);
        no_checksum[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
        assert!(checksums_ok::<Ipv4Addr>(&no_checksum), "UDP's 0 is none");
    }

    #[test]
    fn ipv4_fragments_carry_offsets_flags_and_id() {
        let (a, b) = (Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(203, 0, 113, 10));
        let datagram: Vec<u8> = (0..100u8).collect();
        let frags = fragments(a, b, UDP, &datagram, 0x0102_0304, 48);
        let fields: Vec<(u16, u16, bool)> = frags
            .iter()
            .map(|f| {
                let p = Ipv4Addr::packet_at(f, IP).unwrap();
                assert!(Ipv4Addr::header_checksum_ok(f, IP));
                assert_eq!((p.src, p.dst, p.proto, p.l4), (a, b, UDP, L4));
                (word(f, IP + 4), word(f, IP + 6), p.partial)
            })
            .collect();
        assert_eq!(
            fields,
            [
                (0x0304, 0x2000, true),
                (0x0304, 0x2006, true),
                (0x0304, 12, true)
            ]
        );
        let whole: Vec<u8> = frags.iter().flat_map(|f| f[L4..].to_vec()).collect();
        assert_eq!(whole, datagram);
    }

    #[test]
    fn extension_headers_are_chained_and_walked() {
        let exts = [
            ExtHeader::hop_by_hop(0),
            ExtHeader::routing(2),
            ExtHeader::destination_options(1),
            ExtHeader::auth(4),
        ];
        assert_eq!(
            exts.iter().map(ExtHeader::len).collect::<Vec<_>>(),
            [8, 24, 16, 24]
        );
        let f = insert_ext6(&tcp(A, 1, B, 2, SYN), &exts);
        assert_eq!(word(&f, IP + 4) as usize, f.len() - L4_6, "payload length");
        let h = headers6(&f).unwrap();
        assert_eq!((h.proto, h.l4), (TCP, L4_6 + 72));
        assert_eq!(
            h.exts,
            [
                (NH_HOP_BY_HOP, 54, 8),
                (NH_ROUTING, 62, 24),
                (NH_DEST_OPTS, 86, 16),
                (NH_AUTH, 102, 24)
            ]
        );
        assert!(
            checksums_ok::<Ipv6Addr>(&f),
            "extension headers are outside the checksum"
        );
        assert_eq!(f, frame6_ext(A, B, &exts, TCP, &f[h.l4..]));
        // Cut in the middle of the chain: no upper layer to find.
        assert_eq!(headers6(&f[..70]), None);
    }

    #[test]
    fn fragments_carry_offsets_flags_and_id() {
        let datagram: Vec<u8> = (0..100u8).collect();
        let frags = fragments(A, B, UDP, &datagram, 0x0102_0304, 48);
        assert_eq!(frags.len(), 3);
        let fields: Vec<Frag6> = frags
            .iter()
            .map(|f| headers6(f).unwrap().fragment.unwrap())
            .collect();
        assert_eq!(
            fields
                .iter()
                .map(|f| (f.offset, f.more, f.id))
                .collect::<Vec<_>>(),
            [
                (0, true, 0x0102_0304),
                (6, true, 0x0102_0304),
                (12, false, 0x0102_0304)
            ]
        );
        assert_eq!(&frags[1][L4_6..L4_6 + 8], [UDP, 0, 0, 0x31, 1, 2, 3, 4]);
        let later = headers6(&frags[2]).unwrap();
        assert!(later.is_later_fragment() && later.is_partial());
        assert_eq!((later.proto, later.l4), (UDP, L4_6 + 8));
        assert!(
            !checksums_ok::<Ipv6Addr>(&frags[0]),
            "a fragment cannot be checked alone"
        );
    }

    #[test]
    fn checksum_adjustment_matches_a_recomputation() {
        let f = udp(A, 1000, B, 53);
        let mut g = udp(B, 2000, B, 53);
        g[SRC6..SRC6 + 16].copy_from_slice(&B.octets());
        let old: Vec<u8> = [&f[SRC6..SRC6 + 16], &f[L4_6..L4_6 + 2]].concat();
        let new: Vec<u8> = [&g[SRC6..SRC6 + 16], &g[L4_6..L4_6 + 2]].concat();
        let adjusted = checksum_adjusted(word(&f, L4_6 + 6), &old, &new);
        assert!(same_checksum(adjusted, word(&g, L4_6 + 6)));
        assert!(same_checksum(0, 0xffff) && !same_checksum(1, 0xfffe));
    }
}

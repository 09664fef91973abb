//! Ethernet + IPv4 and Ethernet + IPv6 frames built from scratch, with checksums computed in
//! full by this module's own code, for the packet tests and the data-path benchmark. Sharing
//! nothing with the eBPF programs' incremental checksum updates is the point: a test that checks
//! a translation with this code checks it independently.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    ops::Range,
};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
/// Where the L4 header starts in the frames built here (Ethernet, option-less IPv4).
pub const L4: usize = 34;

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

/// A TCP or UDP segment (8-byte UDP header, 20-byte TCP header) with a payload and a correct
/// checksum over the pseudo-header.
pub fn l4_segment(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    let mut s = segment_without_checksum(proto, sport, dport, flags);
    let c = checksum(&[pseudo_header(src, dst, proto, s.len()), s.clone()].concat());
    let off = if proto == TCP { 16 } else { 6 };
    s[off..off + 2].copy_from_slice(&c.to_be_bytes());
    s
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

    /// The segment from `src` to `dst`, of either family, its checksum computed over their
    /// pseudo-header.
    pub fn segment(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let mut seg = self.without_checksum();
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                let c = checksum(&[pseudo_header(src, dst, TCP, seg.len()), seg.clone()].concat());
                seg[16..18].copy_from_slice(&c.to_be_bytes());
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => fill_checksum6(src, dst, TCP, &mut seg),
            _ => panic!("{src} and {dst} are of two families"),
        }
        seg
    }

    /// The segment in a frame from `src` to `dst`, checksums computed.
    pub fn frame(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let seg = self.segment(src, dst);
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => frame(src, dst, TCP, &seg),
            (IpAddr::V6(src), IpAddr::V6(dst)) => frame6(src, dst, TCP, &seg),
            _ => unreachable!("segment() refuses two families"),
        }
    }
}

pub fn icmp_message(kind: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend(rest);
    m.extend(body);
    let c = checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

pub fn echo(kind: u8, id: u16) -> Vec<u8> {
    let [a, b] = id.to_be_bytes();
    icmp_message(kind, 0, [a, b, 0, 1], b"ping payload")
}

pub fn frame(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> Vec<u8> {
    frame_with_frag(src, dst, proto, l4, 0)
}

pub fn frame_with_frag(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8], frag: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend(ipv4_header(src, dst, proto, l4.len(), frag));
    f.extend(l4);
    f
}

pub fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    frame(
        src,
        dst,
        TCP,
        &l4_segment(src, dst, TCP, sport, dport, flags),
    )
}

pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Vec<u8> {
    frame(src, dst, UDP, &l4_segment(src, dst, UDP, sport, dport, 0))
}

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

pub fn src(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(f[26], f[27], f[28], f[29])
}

pub fn dst(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(f[30], f[31], f[32], f[33])
}

pub fn word(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

// ---- IPv6 -----------------------------------------------------------------------------------

pub const ICMPV6: u8 = 58;
pub const ETHERTYPE_IPV6: u16 = 0x86dd;
/// Where the IPv6 header starts in the frames built here.
pub const IP6: usize = 14;
/// The fixed IPv6 header's length.
pub const IPV6_HLEN: usize = 40;
/// Where the source and destination addresses sit in the frames built here.
pub const SRC6: usize = IP6 + 8;
pub const DST6: usize = IP6 + 24;
/// Where the L4 header starts in an IPv6 frame without extension headers.
pub const L4_6: usize = IP6 + IPV6_HLEN;

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

pub fn frame6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, l4: &[u8]) -> Vec<u8> {
    frame6_ext(src, dst, &[], proto, l4)
}

/// `frame` (Ethernet + IPv6) with `exts` inserted right behind its fixed header, ahead of
/// whatever followed it: the chain is relinked and the payload length grown. The upper layer
/// is untouched, and so is its checksum, which extension headers do not enter.
pub fn insert_ext6(frame: &[u8], exts: &[ExtHeader]) -> Vec<u8> {
    if exts.is_empty() {
        return frame.to_vec();
    }
    let mut f = frame.to_vec();
    let chain = ext_chain(exts, f[IP6 + 6]);
    f[IP6 + 6] = exts[0].kind;
    let payload_len = usize::from(word(&f, IP6 + 4)) + chain.len();
    f[IP6 + 4..IP6 + 6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    f.splice(L4_6..L4_6, chain);
    f
}

/// `frame` with its hop limit set to `hops` (255 for neighbour discovery, 1 for MLD).
pub fn with_hop_limit6(frame: &[u8], hops: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[IP6 + 7] = hops;
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

/// Computes the checksum of the upper-layer bytes `seg` (TCP, UDP or ICMPv6) over the IPv6
/// pseudo-header and stores it in place. UDP's 0 is sent as 0xffff (RFC 8200 §8.1).
pub fn fill_checksum6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, seg: &mut [u8]) {
    let off = l4_checksum_offset(proto);
    seg[off..off + 2].copy_from_slice(&[0, 0]);
    let mut c = checksum(&[pseudo_header6(src, dst, proto, seg.len()), seg.to_vec()].concat());
    if proto == UDP && c == 0 {
        c = 0xffff;
    }
    seg[off..off + 2].copy_from_slice(&c.to_be_bytes());
}

/// A TCP or UDP segment laid out as `l4_segment`'s, with its checksum over the IPv6
/// pseudo-header.
pub fn l4_segment6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    proto: u8,
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    let mut s = segment_without_checksum(proto, sport, dport, flags);
    fill_checksum6(src, dst, proto, &mut s);
    s
}

/// An ICMPv6 message, its checksum over the pseudo-header (unlike ICMPv4's).
pub fn icmp6_message(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend(rest);
    m.extend(body);
    fill_checksum6(src, dst, ICMPV6, &mut m);
    m
}

/// An echo request (128) or reply (129) with identifier `id`, sequence 1.
pub fn echo6(src: Ipv6Addr, dst: Ipv6Addr, kind: u8, id: u16) -> Vec<u8> {
    let [a, b] = id.to_be_bytes();
    icmp6_message(src, dst, kind, 0, [a, b, 0, 1], b"ping6 payload")
}

pub fn tcp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Vec<u8> {
    frame6(
        src,
        dst,
        TCP,
        &l4_segment6(src, dst, TCP, sport, dport, flags),
    )
}

pub fn udp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Vec<u8> {
    frame6(src, dst, UDP, &l4_segment6(src, dst, UDP, sport, dport, 0))
}

/// An echo request or reply frame.
pub fn ping6(src: Ipv6Addr, dst: Ipv6Addr, kind: u8, id: u16) -> Vec<u8> {
    frame6(src, dst, ICMPV6, &echo6(src, dst, kind, id))
}

/// An ICMPv6 message in a frame.
pub fn icmp6_frame(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    frame6(
        src,
        dst,
        ICMPV6,
        &icmp6_message(src, dst, kind, code, rest, body),
    )
}

/// The upper-layer `datagram` of protocol `proto` cut into fragments of `size` bytes (a
/// multiple of 8; the last one takes the rest), each in a frame of its own behind a fragment
/// header with identification `id`, first fragment first.
pub fn fragments6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
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
    datagram
        .chunks(size)
        .enumerate()
        .map(|(i, chunk)| {
            let header = ExtHeader::fragment((i * size / 8) as u16, i + 1 < count, id);
            frame6_ext(src, dst, &[header], proto, chunk)
        })
        .collect()
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
    if f.len() < IP6 || word(f, 12) != ETHERTYPE_IPV6 {
        return None;
    }
    headers6_at(f, IP6)
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

/// The upper-layer checksum residual of `seg` under the pseudo-header of (`src`, `dst`,
/// `proto`, `seg.len()`): 0 when the checksum is valid.
pub fn residual6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, seg: &[u8]) -> u16 {
    checksum(&[pseudo_header6(src, dst, proto, seg.len()), seg.to_vec()].concat())
}

/// Whether the upper layer found by `h` in `f` (running to the end of `f`) carries a valid
/// TCP, UDP or ICMPv6 checksum. False for anything that cannot be checked on its own: a partial
/// fragment, a header too short to hold its checksum, another protocol, or a UDP checksum of 0,
/// which IPv6 forbids.
pub fn segment_checksum6_ok(f: &[u8], h: &Headers6) -> bool {
    if h.is_partial() || h.l4 > f.len() {
        return false;
    }
    let seg = &f[h.l4..];
    let min = match h.proto {
        TCP => 20,
        UDP => 8,
        ICMPV6 => 4,
        _ => return false,
    };
    if seg.len() < min || (h.proto == UDP && word(seg, 6) == 0) {
        return false;
    }
    residual6(h.src, h.dst, h.proto, seg) == 0
}

/// Whether an Ethernet + IPv6 frame's upper-layer checksum verifies, computed from scratch
/// after walking the header chain.
pub fn checksum6_ok(f: &[u8]) -> bool {
    headers6(f).is_some_and(|h| segment_checksum6_ok(f, &h))
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
        assert_eq!(word(&tcp6(A, 40000, B, 80, SYN), L4_6 + 16), 0x46ec);
        let f = tcp6(A, 40000, B, 80, SYN);
        assert!(checksum6_ok(&f));
        for i in L4_6..f.len() {
            let mut broken = f.clone();
            broken[i] ^= 0x01;
            assert!(
                !checksum6_ok(&broken),
                "a flipped bit at {i} goes unnoticed"
            );
        }
        // The pseudo-header counts: another address breaks the checksum.
        let mut moved = f.clone();
        moved[SRC6 + 15] ^= 1;
        assert!(!checksum6_ok(&moved));
        assert!(checksum6_ok(&udp6(A, 1, B, 2)));
        assert!(checksum6_ok(&ping6(A, B, ICMPV6_ECHO_REQUEST, 7)));
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
        let f = insert_ext6(&tcp6(A, 1, B, 2, SYN), &exts);
        assert_eq!(word(&f, IP6 + 4) as usize, f.len() - L4_6, "payload length");
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
            checksum6_ok(&f),
            "extension headers are outside the checksum"
        );
        assert_eq!(f, frame6_ext(A, B, &exts, TCP, &f[h.l4..]));
        // Cut in the middle of the chain: no upper layer to find.
        assert_eq!(headers6(&f[..70]), None);
    }

    #[test]
    fn fragments_carry_offsets_flags_and_id() {
        let datagram: Vec<u8> = (0..100u8).collect();
        let frags = fragments6(A, B, UDP, &datagram, 0x0102_0304, 48);
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
            !checksum6_ok(&frags[0]),
            "a fragment cannot be checked alone"
        );
    }

    #[test]
    fn checksum_adjustment_matches_a_recomputation() {
        let f = udp6(A, 1000, B, 53);
        let mut g = udp6(B, 2000, B, 53);
        g[SRC6..SRC6 + 16].copy_from_slice(&B.octets());
        let old: Vec<u8> = [&f[SRC6..SRC6 + 16], &f[L4_6..L4_6 + 2]].concat();
        let new: Vec<u8> = [&g[SRC6..SRC6 + 16], &g[L4_6..L4_6 + 2]].concat();
        let adjusted = checksum_adjusted(word(&f, L4_6 + 6), &old, &new);
        assert!(same_checksum(adjusted, word(&g, L4_6 + 6)));
        assert!(same_checksum(0, 0xffff) && !same_checksum(1, 0xfffe));
    }
}

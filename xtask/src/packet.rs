//! Ethernet + IPv4 frames built from scratch, with checksums computed in full by this module's
//! own code, for the packet tests and the data-path benchmark. Sharing nothing with the eBPF
//! programs' incremental checksum updates is the point: a test that checks a translation with
//! this code checks it independently.

use std::net::Ipv4Addr;

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
    let payload = b"masq-agent test payload";
    let mut s = Vec::new();
    s.extend(sport.to_be_bytes());
    s.extend(dport.to_be_bytes());
    if proto == TCP {
        s.extend(1000u32.to_be_bytes());
        s.extend(0u32.to_be_bytes());
        s.extend([0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    } else {
        s.extend(((8 + payload.len()) as u16).to_be_bytes());
        s.extend([0, 0]);
    }
    s.extend(payload);
    let c = checksum(&[pseudo_header(src, dst, proto, s.len()), s.clone()].concat());
    let off = if proto == TCP { 16 } else { 6 };
    s[off..off + 2].copy_from_slice(&c.to_be_bytes());
    s
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

pub const SYN: u8 = 0x02;
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

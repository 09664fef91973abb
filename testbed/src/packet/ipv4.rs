//! IPv4 as the frames built here lay it out: an option-less header behind Ethernet.

use super::{
    family::{FragmentAt, FrameAddress, IP, IpPacket},
    segment::{ICMP, checksum, word},
};

use std::net::Ipv4Addr;

/// Where the L4 header starts in the frames built here (Ethernet, option-less IPv4).
pub const L4: usize = <Ipv4Addr as FrameAddress>::L4;

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

/// An Ethernet + option-less IPv4 frame whose flags and fragment offset field is `frag`.
pub fn frame_with_frag(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8], frag: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend(ipv4_header(src, dst, proto, l4.len(), frag));
    f.extend(l4);
    f
}

/// The source address of an option-less IPv4 frame.
pub fn src(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::at(f, Ipv4Addr::SRC)
}

/// Its destination.
pub fn dst(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::at(f, Ipv4Addr::DST)
}

impl FrameAddress for Ipv4Addr {
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

/// IPv4's flags-and-offset field: more fragments, and the offset in eight-byte units.
pub const IPV4_MORE_FRAGMENTS: u16 = 0x2000;
pub const IPV4_OFFSET_MASK: u16 = 0x1fff;

//! What both families share: the upper layers' segments, TCP's flags, and checksums computed in
//! full.

use std::net::IpAddr;

use super::family::{FrameAddress, fill_checksum, frame};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;

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

/// The payload of the segments and datagrams built here, unless a test gives one.
const PAYLOAD: &[u8] = b"masq-agent test payload";

/// A TCP segment (20-byte header) or UDP datagram with a payload, its checksum field zero.
pub(super) fn segment_without_checksum(proto: u8, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
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
    pub fn segment<A: FrameAddress>(&self, src: A, dst: A) -> Vec<u8> {
        let mut seg = self.without_checksum();
        fill_checksum(src, dst, TCP, &mut seg);
        seg
    }

    /// The segment in a frame from `src` to `dst`, checksums computed.
    pub fn frame<A: FrameAddress>(&self, src: A, dst: A) -> Vec<u8> {
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

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

pub fn word(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

/// Where the checksum of an upper layer of protocol `proto` sits in its header.
pub fn l4_checksum_offset(proto: u8) -> usize {
    match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    }
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

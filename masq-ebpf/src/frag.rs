//! Fragments. Only a datagram's first fragment carries its ports, so the translation found for
//! it is remembered under the datagram's identity, and its later fragments take the same
//! address (their bytes are all payload: the L4 checksum, in the first fragment, already covers
//! the change). Conntrack on the node reassembles what it forwards and splits it again on the
//! way out, so fragments leave first fragment first.

use masq_ebpf::FragmentKeyV4;

use crate::{maps, parse::Ipv4Header};

#[inline(always)]
fn key(ip: &Ipv4Header, dir: u8) -> FragmentKeyV4 {
    FragmentKeyV4 {
        saddr: ip.saddr,
        daddr: ip.daddr,
        id: ip.id,
        proto: ip.protocol,
        direction: dir,
    }
}

/// Remembers, if `ip` is a first fragment, the address its datagram's fragments take in `dir`:
/// the new source on egress, the new destination on ingress (or the old one, for datagrams
/// left as they are).
#[inline(always)]
pub fn remember(ip: &Ipv4Header, dir: u8, addr: [u8; 4]) {
    if ip.is_first_fragment() {
        // A full table evicts the oldest datagram, whose fragments have long gone.
        let _ = maps::FRAGMENTS_V4.insert(key(ip, dir), addr, 0);
    }
}

/// The address a later fragment takes, if its first fragment went through.
#[inline(always)]
pub fn recall(ip: &Ipv4Header, dir: u8) -> Option<[u8; 4]> {
    // SAFETY: the value is copied out at once.
    maps::FRAGMENTS_V4
        .get_ptr(key(ip, dir))
        .map(|addr| unsafe { *addr })
}

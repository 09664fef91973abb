//! Fragments. Only a datagram's first fragment carries its ports, so the translation found for
//! it is remembered under the datagram's identity, and its later fragments take the same
//! address (their bytes are all payload: the L4 checksum, in the first fragment, already covers
//! the change). Conntrack on the node reassembles what it forwards and splits it again on the
//! way out, so fragments leave first fragment first.

use masq_ebpf::FragmentKey;

use crate::{family::Family, parse::Packet};

#[inline(always)]
fn key<A: Copy>(ip: &Packet<A>, dir: u8) -> FragmentKey<A> {
    FragmentKey {
        saddr: ip.saddr,
        daddr: ip.daddr,
        id: ip.fragment.id,
        proto: ip.proto,
        direction: dir,
        _pad: [0; 2],
    }
}

/// Remembers, if `ip` is a first fragment, the address its datagram's fragments take in `dir`:
/// the new source on egress, the new destination on ingress (or the old one, for datagrams
/// left as they are).
#[inline(always)]
pub fn remember<F: Family>(ip: &Packet<F::Addr>, dir: u8, addr: &F::Addr) {
    if ip.fragment.first {
        remember_first::<F>(ip, dir, addr);
    }
}

step! {
/// A function of its own: the datagram's key takes room that whole packets never need.
fn remember_first<F: Family>(ip: &Packet<F::Addr>, dir: u8, addr: &F::Addr) {
    // A full table evicts the oldest datagram, whose fragments have long gone.
    let _ = F::fragments().insert(key(ip, dir), addr, 0);
}
}

/// The address a later fragment takes, if its first fragment went through.
#[inline(always)]
pub fn recall<F: Family>(ip: &Packet<F::Addr>, dir: u8) -> Option<F::Addr> {
    // SAFETY: the value is copied out at once.
    F::fragments()
        .get_ptr(key(ip, dir))
        .map(|addr| unsafe { *addr })
}

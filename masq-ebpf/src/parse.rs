//! Bounds-checked header access. Every read goes through `TcContext::load`, which copies from the
//! packet with `bpf_skb_load_bytes`, so a short packet yields `Err` rather than a verifier failure.

use aya_ebpf::programs::TcContext;

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;

/// The IPv4 fields the masquerade decision needs.
pub struct Ipv4Summary {
    pub daddr: [u8; 4],
}

/// Parses an Ethernet frame carrying IPv4; `None` for anything else.
#[inline(always)]
pub fn ipv4(ctx: &TcContext) -> Option<Ipv4Summary> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    if ethertype != ETH_P_IP {
        return None;
    }
    let version_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if version_ihl >> 4 != 4 || (version_ihl & 0x0f) < 5 {
        return None;
    }
    Some(Ipv4Summary {
        daddr: ctx.load(ETH_HLEN + 16).ok()?,
    })
}

//! The tc entry points.

use aya_ebpf::{
    bindings::TC_ACT_OK, btf_maps::lpm_trie::Key, macros::classifier, programs::TcContext,
};
use masq_ebpf::Counter;

use crate::{maps, parse};

/// Egress: decide whether a packet leaving the node would be masqueraded.
#[classifier]
pub fn masq_egress(ctx: TcContext) -> i32 {
    let Some(ip) = parse::ipv4(&ctx) else {
        maps::count(Counter::NotInspected);
        return TC_ACT_OK;
    };
    if needs_masquerade_v4(&ip.daddr) {
        maps::count(Counter::MasqueradeCandidate);
    } else {
        maps::count(Counter::NonMasqDestination);
    }
    TC_ACT_OK
}

#[inline(always)]
fn needs_masquerade_v4(daddr: &[u8; 4]) -> bool {
    maps::NON_MASQ_V4.get(&Key::new(32, *daddr)).is_none()
}

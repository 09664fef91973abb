//! The tc entry points and the three decisions they make, named after Cilium's `nat.h`:
//! `snat_v4_needs_masquerade` (egress: rewrite this packet?), `snat_v4_nat` (egress: rewrite the
//! source) and `snat_v4_rev_nat` (ingress: restore the destination of replies, and of ICMP errors
//! about translated flows).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use masq_ebpf::{
    Counter, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, InterfaceV4, NatEntryV4, NatKeyV4, Settings,
    direction, nat_kind,
};

use crate::{
    csum::{self, AddrField},
    frag, maps,
    nat::{self, AllocError},
    parse::{self, Ipv4Header, L4, L4_OFF},
    policy::{is_draining_destination, is_non_masq_destination},
};

#[classifier]
pub fn masq_egress(ctx: TcContext) -> i32 {
    let Some((ip, (iface, settings))) = parse::ipv4(&ctx).zip(interface(&ctx)) else {
        maps::count(Counter::NotInspected);
        return TC_ACT_OK;
    };
    if ip.is_later_fragment() {
        return snat_v4_nat_fragment(&ctx, &ip, &iface).count();
    }
    let l4 = match snat_v4_translatable(&ctx, &ip, &iface) {
        Ok(l4) => l4,
        Err(verdict) => return verdict.count(),
    };
    let key = packet_key(&ip, &l4, direction::EGRESS);
    let progress = progress(&l4);
    // A flow that has an entry keeps it, whatever the policy says now, as conntrack does for
    // upstream's chain: policy changes affect new flows only.
    let entry = match nat::lookup(&key) {
        Some(entry) => {
            nat::refresh(entry, progress);
            // SAFETY: map value pointer from a successful lookup.
            unsafe { *entry }
        }
        None => {
            if let Err(verdict) = snat_v4_needs_masquerade(&ip, &l4, &key) {
                return verdict.count();
            }
            match nat::create_snat(&key, iface.addr, settings, progress) {
                Ok(entry) => entry,
                Err(AllocError::PortsExhausted) => {
                    return Verdict::Drop(Counter::DropPortsExhausted).count();
                }
                Err(AllocError::TableFull) => {
                    return Verdict::Drop(Counter::DropNatTableFull).count();
                }
            }
        }
    };
    snat_v4_nat(&ctx, &ip, &l4, &entry)
}

#[classifier]
pub fn masq_ingress(ctx: TcContext) -> i32 {
    let Some(ip) = parse::ipv4(&ctx) else {
        maps::count(Counter::NotInspected);
        return TC_ACT_OK;
    };
    snat_v4_rev_nat(&ctx, &ip)
}

/// The NAT key of a packet's own tuple, as seen in direction `dir`.
#[inline(always)]
fn packet_key(ip: &Ipv4Header, l4: &L4, dir: u8) -> NatKeyV4 {
    nat::key(ip.saddr, ip.daddr, l4.proto, l4.sport, l4.dport, dir)
}

/// The address of the interface the packet crosses, and the NAT settings; `None` until the
/// agent has configured both. Egress needs them for every packet; ingress only for packets of
/// no known flow, so replies skip the lookups.
#[inline(always)]
fn interface(ctx: &TcContext) -> Option<(InterfaceV4, &'static Settings)> {
    // SAFETY: the context pointer is valid for the program's run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: the value is copied out at once.
    let iface = unsafe { *maps::INTERFACES.get_ptr(ifindex)? };
    let settings = maps::settings().filter(|s| s.total_ports != 0)?;
    Some((iface, settings))
}

/// What happens to a packet, and the counter that records why.
enum Verdict {
    Keep(Counter),
    Drop(Counter),
}

impl Verdict {
    /// A translated packet goes on, counted as `done`; one whose rewrite failed half-way is
    /// dropped rather than sent half-translated.
    #[inline(always)]
    fn after_rewrite(rewritten: Result<(), i64>, done: Counter) -> i32 {
        Verdict::after(rewritten, done).count()
    }

    #[inline(always)]
    fn after(rewritten: Result<(), i64>, done: Counter) -> Verdict {
        match rewritten {
            Ok(()) => Verdict::Keep(done),
            Err(_) => Verdict::Drop(Counter::DropRewriteFailed),
        }
    }

    #[inline(always)]
    fn count(self) -> i32 {
        match self {
            Verdict::Keep(counter) => {
                maps::count(counter);
                TC_ACT_OK
            }
            Verdict::Drop(counter) => {
                maps::count(counter);
                TC_ACT_SHOT
            }
        }
    }
}

/// Egress packets that no translation here is for, whatever their L4 header: the node's own,
/// and protocols left to the chain.
#[inline(always)]
fn snat_v4_left_alone(ip: &Ipv4Header, iface: &InterfaceV4) -> Option<Verdict> {
    if ip.saddr == iface.addr {
        return Some(Verdict::Keep(Counter::NotMasqNodeSource));
    }
    if !matches!(ip.protocol, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMP) {
        return Some(Verdict::Keep(Counter::NotMasqOtherProtocol));
    }
    None
}

/// Egress: could this packet be translated at all? Its L4 header if so.
#[inline(always)]
fn snat_v4_translatable(
    ctx: &TcContext,
    ip: &Ipv4Header,
    iface: &InterfaceV4,
) -> Result<L4, Verdict> {
    if let Some(verdict) = snat_v4_left_alone(ip, iface) {
        return Err(verdict);
    }
    let Some(l4) = parse::l4(ctx, L4_OFF, ip.protocol) else {
        return Err(Verdict::Keep(Counter::NotInspected));
    };
    if l4.proto == IPPROTO_ICMP && l4.icmp_type != parse::ICMP_ECHO_REQUEST {
        return Err(Verdict::Keep(Counter::NotMasqIcmpOther));
    }
    Ok(l4)
}

/// Egress, for a flow without an entry: should it leave with the node's address?
#[inline(always)]
fn snat_v4_needs_masquerade(ip: &Ipv4Header, l4: &L4, key: &NatKeyV4) -> Result<(), Verdict> {
    if is_non_masq_destination(ip.daddr) {
        return Err(Verdict::Keep(Counter::NotMasqNonMasqDestination));
    }
    // A TCP connection past its SYN, to a destination that just left the non-masquerade CIDRs,
    // started unmasqueraded: translating it now would break it.
    if l4.proto == IPPROTO_TCP
        && l4.tcp_flags & TCP_SYN == 0
        && is_draining_destination(ip.daddr)
        && nat::track_passthrough(key, nat::tcp_progress(l4.tcp_flags))
    {
        return Err(Verdict::Keep(Counter::NotMasqInbound));
    }
    Ok(())
}

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

#[inline(always)]
fn progress(l4: &L4) -> u8 {
    if l4.proto == IPPROTO_TCP {
        nat::tcp_progress(l4.tcp_flags)
    } else {
        0
    }
}

/// Egress, a fragment after the first: it carries no ports, so it takes the source its first
/// fragment took. One without a known first fragment is dropped rather than sent with the pod's
/// address, unless nothing would have translated it anyway.
#[inline(always)]
fn snat_v4_nat_fragment(ctx: &TcContext, ip: &Ipv4Header, iface: &InterfaceV4) -> Verdict {
    if let Some(addr) = frag::recall(ip, direction::EGRESS) {
        if addr == ip.saddr {
            return Verdict::Keep(Counter::NotMasqInbound);
        }
        let rewritten = csum::rewrite_ipv4_addr(ctx, ip, AddrField::Source, addr, None);
        return Verdict::after(rewritten, Counter::Masqueraded);
    }
    if let Some(verdict) = snat_v4_left_alone(ip, iface) {
        return verdict;
    }
    if is_non_masq_destination(ip.daddr) {
        return Verdict::Keep(Counter::NotMasqNonMasqDestination);
    }
    Verdict::Drop(Counter::DropFragment)
}

/// Egress: rewrite the source as the flow's entry says.
#[inline(always)]
fn snat_v4_nat(ctx: &TcContext, ip: &Ipv4Header, l4: &L4, entry: &NatEntryV4) -> i32 {
    if entry.kind == nat_kind::PASSTHROUGH {
        frag::remember(ip, direction::EGRESS, ip.saddr);
        return Verdict::Keep(Counter::NotMasqInbound).count();
    }
    frag::remember(ip, direction::EGRESS, entry.addr);
    let field = if l4.proto == IPPROTO_ICMP {
        parse::ICMP_ID_OFF
    } else {
        0
    };
    let rewritten = rewrite(ctx, ip, AddrField::Source, field, l4.proto, l4.sport, entry);
    Verdict::after_rewrite(rewritten, Counter::Masqueraded)
}

/// Rewrites one address (source or destination) and the matching L4 word (port or echo id) to
/// the entry's, with every checksum that covers them.
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    ip: &Ipv4Header,
    addr: AddrField,
    l4_field: usize,
    proto: u8,
    old_word: u16,
    entry: &NatEntryV4,
) -> Result<(), i64> {
    let csum_off = L4_OFF + parse::l4_csum_off(proto);
    let pseudo = (proto != IPPROTO_ICMP).then_some((csum_off, proto));
    if addr.of(ip) != entry.addr {
        csum::rewrite_ipv4_addr(ctx, ip, addr, entry.addr, pseudo)?;
    }
    if old_word != entry.port {
        csum::rewrite_l4_word(
            ctx,
            L4_OFF + l4_field,
            csum_off,
            proto,
            old_word,
            entry.port,
        )?;
    }
    Ok(())
}

/// Ingress: restore the pod's address in replies to masqueraded flows, and remember connections
/// opened from outside toward pods.
#[inline(always)]
fn snat_v4_rev_nat(ctx: &TcContext, ip: &Ipv4Header) -> i32 {
    if ip.is_later_fragment() {
        return snat_v4_rev_nat_fragment(ctx, ip);
    }
    let Some(l4) = parse::l4(ctx, L4_OFF, ip.protocol) else {
        return TC_ACT_OK;
    };
    let (key, field) = match (l4.proto, l4.icmp_type) {
        (IPPROTO_TCP | IPPROTO_UDP, _) => (packet_key(ip, &l4, direction::INGRESS), 2),
        // Replies carry the identifier the request left with, the key's pod-side port.
        (IPPROTO_ICMP, parse::ICMP_ECHO_REPLY) => {
            let key = nat::key(
                ip.saddr,
                ip.daddr,
                IPPROTO_ICMP,
                0,
                l4.sport,
                direction::INGRESS,
            );
            (key, parse::ICMP_ID_OFF)
        }
        (IPPROTO_ICMP, parse::ICMP_DEST_UNREACH | parse::ICMP_TIME_EXCEEDED) => {
            return snat_v4_rev_nat_icmp_error(ctx, ip);
        }
        _ => return TC_ACT_OK,
    };
    let progress = progress(&l4);
    let Some(entry) = nat::lookup(&key) else {
        // A connection opened from outside toward a pod's own address. A TCP connection opens
        // with a SYN: stray segments (to an address the node no longer has, say) open nothing.
        if l4.proto != IPPROTO_ICMP
            && (l4.proto != IPPROTO_TCP || l4.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN)
            && interface(ctx).is_some_and(|(iface, _)| ip.daddr != iface.addr)
            && !is_non_masq_destination(ip.saddr)
            && nat::track_passthrough(&nat::egress_key_of(&key), progress)
        {
            maps::count(Counter::InboundTracked);
        }
        return TC_ACT_OK;
    };
    nat::refresh(entry, progress);
    // SAFETY: map value pointer from a successful lookup.
    let entry = unsafe { *entry };
    if entry.kind != nat_kind::SNAT {
        return TC_ACT_OK;
    }
    frag::remember(ip, direction::INGRESS, entry.addr);
    let rewritten = rewrite(
        ctx,
        ip,
        AddrField::Destination,
        field,
        l4.proto,
        key.dport,
        &entry,
    );
    Verdict::after_rewrite(rewritten, Counter::ReverseTranslated)
}

/// Ingress, a fragment after the first: it takes the destination its first fragment took. One
/// without a known first fragment passes as it is: it may well be the node's own.
#[inline(always)]
fn snat_v4_rev_nat_fragment(ctx: &TcContext, ip: &Ipv4Header) -> i32 {
    match frag::recall(ip, direction::INGRESS) {
        Some(addr) if addr != ip.daddr => {
            let rewritten = csum::rewrite_ipv4_addr(ctx, ip, AddrField::Destination, addr, None);
            Verdict::after_rewrite(rewritten, Counter::ReverseTranslated)
        }
        _ => TC_ACT_OK,
    }
}

const INNER_IP_OFF: usize = L4_OFF + 8;
/// What a rewrite reports when the field it must read back is not in the packet.
const EFAULT: i64 = -14;
const INNER_L4_OFF: usize = INNER_IP_OFF + parse::IPV4_HLEN;

/// Ingress ICMP error (destination unreachable, fragmentation needed, time exceeded) about a
/// packet we masqueraded: it quotes that packet as it left, from the node's address and NAT
/// port. Translate the outer destination and the quoted source back to the pod, and fix the
/// outer IP, quoted IP, quoted L4 and ICMP checksums.
#[inline(always)]
fn snat_v4_rev_nat_icmp_error(ctx: &TcContext, ip: &Ipv4Header) -> i32 {
    let Some(inner) = parse::ipv4_at(ctx, INNER_IP_OFF) else {
        return TC_ACT_OK;
    };
    if inner.saddr != ip.daddr {
        return TC_ACT_OK;
    }
    // Errors need only quote 8 bytes of L4 header: enough for ports, or an echo identifier.
    let Some(quoted) = parse::quoted_l4(ctx, INNER_L4_OFF, inner.protocol) else {
        return TC_ACT_OK;
    };
    // The quoted packet went out; a reply to it would have come in as this key.
    let (sport, dport, field) = match quoted.proto {
        IPPROTO_ICMP if quoted.icmp_type == parse::ICMP_ECHO_REQUEST => {
            (0, quoted.sport, parse::ICMP_ID_OFF)
        }
        IPPROTO_TCP | IPPROTO_UDP => (quoted.dport, quoted.sport, 0),
        _ => return TC_ACT_OK,
    };
    let key = nat::key(
        inner.daddr,
        inner.saddr,
        quoted.proto,
        sport,
        dport,
        direction::INGRESS,
    );
    let Some(entry) = nat::lookup(&key) else {
        return TC_ACT_OK;
    };
    // SAFETY: map value pointer from a successful lookup.
    let entry = unsafe { *entry };
    if entry.kind != nat_kind::SNAT {
        return TC_ACT_OK;
    }
    let rewritten = rewrite_icmp_error(ctx, ip, &inner, &quoted, field, key.dport, &entry);
    Verdict::after_rewrite(rewritten, Counter::IcmpErrorTranslated)
}

#[inline(always)]
fn rewrite_icmp_error(
    ctx: &TcContext,
    ip: &Ipv4Header,
    inner: &Ipv4Header,
    quoted: &L4,
    quoted_field: usize,
    nat_word: u16,
    entry: &NatEntryV4,
) -> Result<(), i64> {
    let icmp_csum_off = L4_OFF + parse::ICMP_CSUM_OFF;
    let mut icmp_csum: u16 = parse::read(ctx, icmp_csum_off).ok_or(EFAULT)?;

    // The quoted IP header: source address and its own checksum. ICMP's checksum covers both.
    let inner_check = csum::replace_dword(inner.check, inner.saddr, entry.addr);
    icmp_csum = csum::replace_dword(icmp_csum, inner.saddr, entry.addr);
    icmp_csum = csum::replace_word(icmp_csum, inner.check, inner_check);
    ctx.store(INNER_IP_OFF + 12, &entry.addr, 0)?;
    ctx.store(INNER_IP_OFF + 10, &inner_check, 0)?;

    // The quoted port or echo identifier.
    icmp_csum = csum::replace_word(icmp_csum, nat_word, entry.port);
    ctx.store(INNER_L4_OFF + quoted_field, &entry.port, 0)?;

    // The quoted L4 checksum, when the error quotes enough of the packet to hold it.
    let quoted_csum_off = INNER_L4_OFF + parse::l4_csum_off(quoted.proto);
    if let Some(old) = parse::read::<u16>(ctx, quoted_csum_off)
        && !(quoted.proto == IPPROTO_UDP && old == 0)
    {
        let mut new = csum::replace_word(old, nat_word, entry.port);
        if quoted.proto != IPPROTO_ICMP {
            new = csum::replace_dword(new, inner.saddr, entry.addr);
        }
        if quoted.proto == IPPROTO_UDP && new == 0 {
            new = 0xffff;
        }
        icmp_csum = csum::replace_word(icmp_csum, old, new);
        ctx.store(quoted_csum_off, &new, 0)?;
    }
    ctx.store(icmp_csum_off, &icmp_csum, 0)?;

    // The outer destination. ICMP has no pseudo-header, so only the IP checksum changes.
    csum::rewrite_ipv4_addr(ctx, ip, AddrField::Destination, entry.addr, None)
}
